"""The collector: the services' start-up objects frozen, young collections rarer; the in-process
engine's thresholds raised only while it steps."""

import gc
import weakref

import pytest
from pagedserve.services.common.gc_tuning import (
    GEN0_THRESHOLD,
    GEN2_THRESHOLD,
    raised_thresholds,
    tune_gc_after_load,
    tune_gc_after_startup,
)


def test_tune_gc_freezes_what_exists_and_raises_the_thresholds():
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults: an in-process service may have tuned it
    kept = [object() for _ in range(10)]
    try:
        tune_gc_after_startup()
        assert gc.get_threshold()[0] == GEN0_THRESHOLD > 700
        assert gc.get_freeze_count() > len(kept)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_a_reload_unfreezes_so_a_replaced_model_is_collected():
    """The worker's: what one load froze is collected after the next load replaced it."""
    class Model:
        pass

    before = gc.get_threshold()
    model = Model()
    model.cycle = model  # freed only by the collector
    replaced = weakref.ref(model)
    try:
        tune_gc_after_load()
        del model
        gc.collect()
        assert replaced() is not None  # frozen: never scanned
        tune_gc_after_load()
        assert replaced() is None
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def test_raised_thresholds_raise_none_below_the_callers_and_restore_them():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 50, 10)
        with raised_thresholds():
            assert gc.get_threshold() == (GEN0_THRESHOLD, 50, GEN2_THRESHOLD)
        assert gc.get_threshold() == (700, 50, 10)
        with pytest.raises(RuntimeError), raised_thresholds():
            raise RuntimeError("a step failed")
        assert gc.get_threshold() == (700, 50, 10)
    finally:
        gc.set_threshold(*before)
