"""The host-memory KV tier in the BlockManager: a prefix-cache block evicted from the GPU is copied
to a host block, a later hit copies it back (so the KV a sequence reads is the KV its tokens
made), LRU drops over the tier's budget with a CPU BlockRemoved, and preemption by swap keeps its
own CPU blocks. A fake worker replays the copies the way the real one does: swap out, then swap
in, then the forward."""

from __future__ import annotations

import pytest
from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.metrics import SchedulerMetrics
from pagedserve.scheduler_svc.stats import HostCopyStats, StepStats, StepTotals
from pagedserve.services.common.kv_events import MEDIUM_CPU, MEDIUM_GPU, BlockRemoved, BlockStored
from pagedserve.services.common.step_plan import StepTimings
from prometheus_client import CollectorRegistry

BS = 4
NUM_SWAP_BLOCKS = 4


class FakeWorker:
    """Each block holds the tokens whose KV it would hold."""

    def __init__(self) -> None:
        self.gpu: dict[int, tuple[int, ...]] = {}
        self.cpu: dict[int, tuple[int, ...]] = {}

    def step(self, bm: BlockManager, prompts: dict[int, list[int]],
             num_cached: dict[int, int]) -> None:
        offloads, onloads = bm.take_host_copies()
        for gpu, cpu in offloads:
            self.cpu[cpu] = self.gpu[gpu]
        for cpu, gpu in onloads:
            self.gpu[gpu] = self.cpu[cpu]
        for seq_id, tokens in prompts.items():
            table = bm.block_table(seq_id)
            for i in range(num_cached[seq_id] // BS):
                assert self.gpu[table[i]] == tuple(tokens[i * BS:(i + 1) * BS]), (seq_id, i)
            for i in range(num_cached[seq_id] // BS, len(table)):
                self.gpu[table[i]] = tuple(tokens[i * BS:(i + 1) * BS])
            bm.mark_computed(seq_id, tokens, len(tokens))


def _manager(num_gpu_blocks: int = 4, num_offload_blocks: int = 8) -> BlockManager:
    return BlockManager(BS, num_gpu_blocks, NUM_SWAP_BLOCKS, watermark=0.0,
                        enable_prefix_caching=True, num_offload_blocks=num_offload_blocks)


def _run(bm: BlockManager, worker: FakeWorker, prompts: dict[int, list[int]],
         free: bool = True) -> dict[int, int]:
    num_cached = {seq_id: bm.allocate(seq_id, tokens) for seq_id, tokens in prompts.items()}
    worker.step(bm, prompts, num_cached)
    if free:
        for seq_id in prompts:
            bm.free(seq_id)
    return num_cached


def _events(bm: BlockManager):
    return [e for batch in bm.kv_events.read(bm.kv_events.log_id, 0) for e in batch.events]


A = list(range(100, 113))  # 3 full blocks and one token
B = list(range(200, 213))


def test_an_evicted_block_is_copied_to_a_host_block_past_the_swap_space():
    bm, worker = _manager(), FakeWorker()
    _run(bm, worker, {1: A})
    bm.allocate(2, B)  # needs every GPU block: A's three cached ones are evicted
    offloads, onloads = bm.take_host_copies()
    assert len(offloads) == 3 and not onloads
    assert all(cpu >= NUM_SWAP_BLOCKS for _, cpu in offloads)
    assert bm.num_free_cpu_blocks == NUM_SWAP_BLOCKS  # the swap space is untouched
    stored_cpu = [e for e in _events(bm) if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU]
    removed_gpu = [e for e in _events(bm) if isinstance(e, BlockRemoved)
                   and e.medium == MEDIUM_GPU]
    assert len(stored_cpu) == 3 and len(removed_gpu) == 3
    # each host block names its parent as the GPU block did (the tail is evicted first)
    assert stored_cpu[0].parent_block_hash == stored_cpu[1].block_hashes[0]
    assert stored_cpu[2].parent_block_hash is None
    assert bm.kv_events.num_held_blocks(MEDIUM_CPU) == 3


def test_a_hit_on_the_host_copies_back_the_kv_the_prompt_made():
    bm, worker = _manager(), FakeWorker()
    _run(bm, worker, {1: A})
    _run(bm, worker, {2: B})
    # A's prefix lives only on the host now; B is evicted to the host in the same step
    assert _run(bm, worker, {3: A + [7, 8]}) == {3: 3 * BS}
    assert bm.host_tier.num_onloaded_blocks == 3 and bm.host_tier.num_hit_tokens == 3 * BS
    assert _run(bm, worker, {4: B}) == {4: 3 * BS}
    assert bm.prefix_cache_hits == 6 * BS


def test_without_the_tier_an_evicted_prefix_is_recomputed():
    bm, worker = _manager(num_offload_blocks=0), FakeWorker()
    _run(bm, worker, {1: A})
    _run(bm, worker, {2: B})
    assert _run(bm, worker, {3: A}) == {3: 0}
    assert bm.take_host_copies() == ([], [])


def test_the_least_recently_used_host_block_is_dropped_over_the_budget():
    bm, worker = _manager(num_gpu_blocks=3, num_offload_blocks=4), FakeWorker()
    a, b, c, d = (list(range(start, start + 9)) for start in (100, 200, 300, 400))
    for seq_id, prompt in enumerate((a, b, c)):  # two full blocks each: a and b fill the tier
        _run(bm, worker, {seq_id: prompt})
    assert _run(bm, worker, {10: a}) == {10: 2 * BS}  # a is used again; b is dropped for c
    _run(bm, worker, {11: d})  # a leaves the GPU again: already on the host, it is touched
    assert bm.kv_events.num_held_blocks(MEDIUM_CPU) == 4
    removed_cpu = [h for e in _events(bm) if isinstance(e, BlockRemoved)
                   and e.medium == MEDIUM_CPU for h in e.block_hashes]
    assert len(removed_cpu) == 2
    assert _run(bm, worker, {12: b}) == {12: 0}  # d goes to the host: c, not a, is dropped
    assert _run(bm, worker, {13: a}) == {13: 2 * BS}
    assert _run(bm, worker, {14: c}) == {14: 0}


def test_preemption_swaps_into_its_own_blocks_beside_a_full_tier():
    bm, worker = _manager(num_gpu_blocks=8, num_offload_blocks=3), FakeWorker()
    _run(bm, worker, {1: A})
    _run(bm, worker, {2: B, 3: list(range(300, 313))}, free=False)  # A's blocks to the tier
    assert bm.host_tier.num_cached_blocks == 3
    assert bm.can_swap_out([2])
    pairs = bm.swap_out([2])
    assert all(cpu < NUM_SWAP_BLOCKS for _, cpu in pairs)
    assert bm.host_tier.num_cached_blocks == 3  # the tier lost nothing to the swap
    assert bm.swap_in([2]) and not bm.is_swapped(2)


def test_a_failed_step_forgets_the_blocks_its_copies_would_have_filled():
    bm, worker = _manager(), FakeWorker()
    _run(bm, worker, {1: A})
    _run(bm, worker, {2: B})
    assert bm.allocate(3, A) == 3 * BS  # onloads A, offloads B: the step fails before its copies
    offloads, onloads = bm.take_host_copies()
    assert len(offloads) == 3 and len(onloads) == 3
    bm.forget_host_copies(offloads, onloads)
    bm.free(3)
    assert bm.num_free_gpu_blocks == 4
    # A is copied back again (its host copy was good); B, never copied out, is recomputed
    assert _run(bm, worker, {4: A}) == {4: 3 * BS}
    assert _run(bm, worker, {5: B}) == {5: 0}
    assert bm.kv_events.num_held_blocks(MEDIUM_GPU) == 3


def test_a_reset_forgets_the_host_tier():
    bm, worker = _manager(), FakeWorker()
    _run(bm, worker, {1: A})
    _run(bm, worker, {2: B})
    bm.reset_prefix_cache()
    assert bm.host_tier.num_cached_blocks == 0
    assert bm.take_host_copies() == ([], [])
    assert _run(bm, worker, {3: A}) == {3: 0}


def test_metrics_split_hits_by_tier_and_count_the_tier_copies_apart_from_swaps():
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, "m", lambda: None)
    metrics.record_step(StepStats.between(
        StepTotals(), StepTotals(num_prefix_cache_queries=64, num_prefix_cache_hits=48,
                                 num_host_cache_hits=32),
        num_scheduled_tokens=16, num_blocks_swapped_in=1, num_blocks_swapped_out=0,
        schedule_time_s=0.001, num_blocks_offloaded=3, num_blocks_onloaded=4))

    def value(name: str, **labels: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m", **labels})

    assert value("pagedserve:prefix_cache_hits_by_tier_total", tier="gpu") == 16
    assert value("pagedserve:prefix_cache_hits_by_tier_total", tier="cpu") == 32
    assert value("pagedserve:kv_offload_blocks_total", direction="offload") == 3
    assert value("pagedserve:kv_offload_blocks_total", direction="onload") == 4
    assert value("pagedserve:swapped_blocks_total", direction="in") == 1


def test_the_tier_copies_get_their_bytes_and_their_share_of_the_workers_swap_time():
    """Three offloads beside one preemption swap-out share the step's 8 ms swap-out; the four
    onloads are the whole swap-in."""
    copies = HostCopyStats.of(num_offloaded=3, num_swapped_out=4, num_onloaded=4,
                              num_swapped_in=4, bytes_per_block=1024,
                              timings=StepTimings(swap_out_ns=8_000_000, swap_in_ns=2_000_000))
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, "m", lambda: None)
    metrics.record_step(StepStats.between(
        StepTotals(), StepTotals(), num_scheduled_tokens=16, num_blocks_swapped_in=0,
        num_blocks_swapped_out=1, schedule_time_s=0.001, num_blocks_offloaded=3,
        num_blocks_onloaded=4, host_copies=copies))

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m"})

    assert value("vllm:kv_offload_store_bytes_total") == 3 * 1024
    assert value("vllm:kv_offload_load_bytes_total") == 4 * 1024
    assert value("vllm:kv_offload_store_time_total") == pytest.approx(0.006)
    assert value("vllm:kv_offload_load_time_total") == pytest.approx(0.002)
