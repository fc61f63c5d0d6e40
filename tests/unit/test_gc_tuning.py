"""The service processes' collector: start-up objects frozen, young collections rarer."""

import gc

from pagedserve.services.common.gc_tuning import GEN0_THRESHOLD, tune_gc_after_startup


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
