"""A newer scheduler takes a live worker over with the handshake alone: the epoch moves only
through init_cache (never ClearState or a step), a KV cache of the asked sizes is kept and
another size is re-created, the mirrors start empty, and the memory profile is the one taken
before the first cache."""

from __future__ import annotations

import pytest
from pagedserve.services.common.errors import StaleEpoch

from tests.integration.worker_driver import Driver, make_worker

EPOCH = 1_700_000_000_000_011  # the clock's, as EngineCore makes them


def test_a_takeover_with_the_same_sizes_keeps_the_model_and_the_cache(tiny_model_dir):
    driver = Driver(make_worker(tiny_model_dir("llama"), epoch=EPOCH), epoch=EPOCH)
    worker = driver.worker
    model, cache = worker.runner.model, worker.cache_engine
    driver.add(0, [5, 6, 7])
    before = driver.step({0: 3}).sampled_by_seq()[0].token_ids
    assert len(worker.runner.mirrors) == 1
    profile = worker.profile_memory()

    assert worker.init_cache(cache.num_gpu_blocks, cache.num_cpu_blocks, EPOCH + 1) is True
    assert worker.cache_engine is cache and worker.runner.model is model
    assert len(worker.runner.mirrors) == 0 and worker.steps.last_step_id == 0
    assert worker.profile_memory() == profile
    with pytest.raises(StaleEpoch):  # the predecessor's steps and ClearState are refused
        driver.step({})
    with pytest.raises(StaleEpoch):
        worker.clear_state(EPOCH)

    fresh = Driver(worker, epoch=EPOCH + 1)  # the new scheduler: it knows no sequence
    fresh.add(0, [5, 6, 7])
    assert fresh.step({0: 3}).sampled_by_seq()[0].token_ids == before


def test_a_takeover_with_other_sizes_re_creates_the_cache(tiny_model_dir):
    worker = make_worker(tiny_model_dir("llama"), num_gpu_blocks=24, num_cpu_blocks=4,
                         epoch=EPOCH)
    cache = worker.cache_engine
    assert worker.init_cache(16, 4, EPOCH + 1) is False
    assert worker.cache_engine is not cache and worker.cache_engine.num_gpu_blocks == 16
    assert worker.scheduler_epoch == EPOCH + 1


@pytest.mark.parametrize("epoch", [EPOCH - 1, EPOCH + 1, 2**64 - 1])
def test_only_the_handshake_moves_the_epoch(tiny_model_dir, epoch):
    """A stray ClearState with a foreign epoch -- larger ones included -- is refused and changes
    nothing; a smaller epoch cannot take the worker back with the handshake either."""
    worker = make_worker(tiny_model_dir("llama"), num_gpu_blocks=16, num_cpu_blocks=4,
                         epoch=EPOCH)
    with pytest.raises(StaleEpoch) as refused:
        worker.clear_state(epoch)
    assert str(EPOCH) not in str(refused.value)
    assert worker.scheduler_epoch == EPOCH
    if epoch < EPOCH:
        with pytest.raises(StaleEpoch):
            worker.init_cache(16, 4, epoch)
        assert worker.scheduler_epoch == EPOCH
    elif epoch == EPOCH + 1:
        worker.init_cache(16, 4, epoch)
        assert worker.scheduler_epoch == epoch
    # an epoch far ahead of the clock is refused at the handshake: test_worker_lifecycle.py


def test_the_memory_profile_is_measured_once(tiny_model_dir, monkeypatch):
    worker = make_worker(tiny_model_dir("llama"), epoch=EPOCH)
    first = worker.profile_memory()

    def measure_again():
        raise AssertionError("profiled again with the KV cache allocated")

    monkeypatch.setattr(worker, "_profile_memory", measure_again)
    assert worker.profile_memory() == first
