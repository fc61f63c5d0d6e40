"""The service processes' collector: start-up objects frozen, young collections rarer."""

import gc
import weakref

from pagedserve.services.common.gc_tuning import (
    GEN0_THRESHOLD,
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
