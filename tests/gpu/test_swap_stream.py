"""Swaps on CUDA: async copies on a side stream between pinned host and device memory, ordered
against the compute stream at both ends, never blocking the host, and exact. Skipped without
CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from tests.gpu.gpu_worker import cuda_worker, prompt
from tests.integration.worker_driver import Driver

pytestmark = pytest.mark.gpu

# clock cycles of torch.cuda._sleep: ~0.5 s at the ~2 GHz of current data-center GPUs
LONG_KERNEL_CYCLES = 1_000_000_000


def test_swaps_wait_for_queued_compute_and_compute_waits_for_them(tiny_model_dir):
    worker = cuda_worker(tiny_model_dir("llama"), num_gpu_blocks=64, num_cpu_blocks=16)
    engine = worker.cache_engine
    old_blocks, new_blocks = list(range(0, 32, 2)), list(range(33, 64, 2))
    cpu_blocks = list(range(16))
    generator = torch.Generator(device="cuda").manual_seed(0)
    values = [torch.randn(layer.shape, generator=generator, device="cuda", dtype=layer.dtype)
              for layer in engine.gpu_cache]
    torch.cuda.synchronize()

    # The values land behind a long kernel: a swap-out that did not wait would copy zeros.
    torch.cuda._sleep(LONG_KERNEL_CYCLES)
    for layer, value in zip(engine.gpu_cache, values, strict=True):
        layer.copy_(value)
    start = time.perf_counter()
    engine.swap_out(list(zip(old_blocks, cpu_blocks, strict=True)))
    assert time.perf_counter() - start < 0.25, "swap_out waited for the device"
    # compute queued after the swap-out must not overwrite the blocks before they are copied
    for layer in engine.gpu_cache:
        layer.zero_()
    engine.swap_in(list(zip(cpu_blocks, new_blocks, strict=True)))
    # and compute queued after the swap-in reads the swapped-in blocks
    snapshot = [layer.clone() for layer in engine.gpu_cache]
    torch.cuda.synchronize()

    others = [b for b in range(64) if b not in new_blocks]
    for value, after, cpu_layer in zip(values, snapshot, engine.cpu_cache, strict=True):
        assert torch.equal(after[:, new_blocks], value[:, old_blocks])
        assert not after[:, others].any()
        assert torch.equal(cpu_layer[:, cpu_blocks], value[:, old_blocks].cpu())


def test_a_swap_in_that_need_not_wait_overlaps_queued_compute_and_compute_after_waits(
        tiny_model_dir):
    """What a step launched ahead does with a host-tier hit whose blocks the step in flight does
    not use: the copy runs while that step's compute is still queued, and what is queued after
    reads the copied blocks."""
    worker = cuda_worker(tiny_model_dir("llama"), num_gpu_blocks=64, num_cpu_blocks=16)
    engine = worker.cache_engine
    cpu_blocks, gpu_blocks = list(range(8)), list(range(40, 48))
    generator = torch.Generator().manual_seed(0)
    for layer in engine.cpu_cache:
        layer[:, cpu_blocks] = torch.randn(layer[:, cpu_blocks].shape, generator=generator
                                           ).to(layer.dtype)
    torch.cuda.synchronize()

    torch.cuda._sleep(LONG_KERNEL_CYCLES)  # the step in flight
    engine.swap_in(list(zip(cpu_blocks, gpu_blocks, strict=True)), wait_for_compute=False)
    copied = torch.cuda.Event()
    copied.record(engine.swap_stream)
    copied.synchronize()
    assert not torch.cuda.current_stream().query(), "the swap-in waited for the queued compute"
    snapshot = [layer[:, gpu_blocks].clone() for layer in engine.gpu_cache]
    torch.cuda.synchronize()
    for after, cpu_layer in zip(snapshot, engine.cpu_cache, strict=True):
        assert torch.equal(after.cpu(), cpu_layer[:, cpu_blocks])


def _blocks(worker, block_ids: list[int], num_tokens: int) -> list[torch.Tensor]:
    """Every layer's K and V of these device blocks' first num_tokens slots."""
    index = torch.tensor(block_ids, device=worker.device)
    return [layer.index_select(1, index).flatten(1, 2)[:, :num_tokens].clone()
            for layer in worker.cache_engine.gpu_cache]


@pytest.mark.parametrize("enable_cuda_graph", [False, True], ids=["eager", "graphs"])
def test_preempted_sequence_resumes_exactly_after_swap(tiny_model_dir, enable_cuda_graph):
    """Swap out, let another sequence overwrite the freed blocks, swap in to other blocks in the
    same step as the decode that reads them: the KV is bit-exact and greedy generation goes on
    as if nothing happened."""
    path = tiny_model_dir("llama")
    first = prompt(0, 11)
    reference = Driver(cuda_worker(path))
    reference.add(0, first)
    reference.run_to_length([0], len(first) + 24)

    driver = Driver(cuda_worker(path, enable_cuda_graph=enable_cuda_graph))
    seq = driver.add(0, first)
    driver.run_to_length([0], len(first) + 10)
    old_blocks = list(seq.block_ids)
    num_cached = seq.num_computed_tokens
    saved = _blocks(driver.worker, old_blocks, num_cached)
    cpu_blocks = list(range(3, 3 + len(old_blocks)))
    driver.run(driver.plan({}, preempted_seq_ids=[0],
                           blocks_to_swap_out=list(zip(old_blocks, cpu_blocks, strict=True))))
    other = driver.add(1, prompt(1, 8 * len(old_blocks)))
    other.block_ids = list(old_blocks)
    driver.step({1: len(other.token_ids)})
    new_blocks = [driver.free_blocks.pop() for _ in old_blocks]
    seq.block_ids, seq.is_known, seq.num_sent_blocks = new_blocks, False, 0
    plan = driver.plan({0: 1}, blocks_to_swap_in=list(zip(cpu_blocks, new_blocks, strict=True)))
    driver.run(plan)
    for before, after in zip(saved, _blocks(driver.worker, new_blocks, num_cached), strict=True):
        assert torch.equal(after, before)
    driver.run_to_length([0], len(first) + 24)
    assert seq.token_ids == reference.seqs[0].token_ids
    if enable_cuda_graph:
        assert driver.worker.runner.decode_graphs.num_replays > 0
