"""A step with a block id outside its pool, a token id outside the vocabulary or a delta that
does not fit is refused before it touches the KV cache or the mirror: the other sequences go on
as if it never came."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from pagedserve.services.common.errors import InvalidRequest, NotFound
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import NewSequence, RunningSequence

from tests.integration.worker_driver import Driver, make_worker

NUM_GPU_BLOCKS, NUM_CPU_BLOCKS = 16, 4


def _new(token_ids: list[int], block_ids: list[int], **kw) -> NewSequence:
    return NewSequence(seq_id=7, request_id="intruder", token_ids=token_ids,
                       prompt_len=len(token_ids), block_ids=block_ids, num_computed_tokens=0,
                       num_scheduled_tokens=len(token_ids), sampling=SamplingParams(
                           temperature=0.0, **kw))


def _bad_steps(vocab_size: int) -> dict[str, dict]:
    return {
        "block id past the pool": dict(new_seqs=[_new([1, 2], [NUM_GPU_BLOCKS])]),
        "negative block id": dict(new_seqs=[_new([1, 2], [-1])]),
        "token id past the vocabulary": dict(new_seqs=[_new([1, vocab_size], [3])]),
        "stop token id past the vocabulary": dict(
            new_seqs=[_new([1, 2], [3], stop_token_ids=[vocab_size])]),
        "logit bias past the vocabulary": dict(
            new_seqs=[_new([1, 2], [3], logit_bias={vocab_size: 1.0})]),
        "allowed token id past the vocabulary": dict(
            new_seqs=[_new([1, 2], [3], allowed_token_ids=[vocab_size])]),
        "bad word token past the vocabulary": dict(
            new_seqs=[_new([1, 2], [3], bad_words_token_ids=[[1, vocab_size]])]),
        "swap-out past the CPU pool": dict(blocks_to_swap_out=[(0, NUM_CPU_BLOCKS)]),
        "swap-in past the device pool": dict(blocks_to_swap_in=[(0, NUM_GPU_BLOCKS)]),
        "copy past the device pool, after a valid one": dict(
            blocks_to_copy=[(1, 2), (2, NUM_GPU_BLOCKS + 5)]),
        "the same sequence twice": dict(new_seqs=[_new([1, 2], [3]), _new([1, 2], [4])]),
        "a delta for an unknown sequence": dict(running_seqs=[RunningSequence(
            99, new_token_ids=[], block_ids_start=0, block_ids=[], num_scheduled_tokens=1)]),
        "a delta whose new block is past the pool": "grow",
    }


def _decode(driver: Driver, num_steps: int) -> list[int]:
    for _ in range(num_steps):
        driver.step({0: 1})
    return driver.seqs[0].token_ids


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> list[int]:
    driver = Driver(make_worker(tiny_model_dir("llama"), num_gpu_blocks=NUM_GPU_BLOCKS,
                                num_cpu_blocks=NUM_CPU_BLOCKS, block_size=8))
    driver.add(0, [5, 6, 7, 8, 9])
    driver.step({0: 5})
    return _decode(driver, 6)


@pytest.mark.parametrize("case", list(_bad_steps(10**6)))
def test_a_bad_step_is_refused_and_harms_no_other_sequence(tiny_model_dir, reference, case):
    worker = make_worker(tiny_model_dir("llama"), num_gpu_blocks=NUM_GPU_BLOCKS,
                         num_cpu_blocks=NUM_CPU_BLOCKS, block_size=8)
    driver = Driver(worker)
    driver.add(0, [5, 6, 7, 8, 9])
    driver.step({0: 5})
    good = driver.plan({0: 1})  # seq 0's next decode, sent alongside the bad parts
    bad = _bad_steps(worker.info.vocab_size)[case]
    if bad == "grow":
        delta = good.running_seqs[0]
        bad = dict(running_seqs=[dataclasses.replace(
            delta, block_ids_start=2, block_ids=[NUM_GPU_BLOCKS + 1])])
    else:
        bad = {k: [*getattr(good, k), *v] for k, v in bad.items()}
    kv_before = [layer.clone() for layer in worker.cache_engine.gpu_cache]
    with pytest.raises((InvalidRequest, NotFound)):
        worker.execute_step(dataclasses.replace(good, **bad))
    assert all(torch.equal(a, b) for a, b in zip(kv_before, worker.cache_engine.gpu_cache,
                                                 strict=True))
    assert set(worker.runner.mirrors.seqs) == {0}
    assert not worker.steps.has_failed
    driver.run(good)  # the same step without the bad parts still runs
    assert _decode(driver, 5) == reference
