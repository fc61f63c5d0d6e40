"""The host-memory KV tier through the in-process engine on a tiny random-weight model: prefixes
that together hold one and a half times the device's blocks come back from the host instead of being
recomputed, and every greedy output is the one recomputing them gives, also with preemption by
swap and worker restarts beside the tier."""

from __future__ import annotations

import pytest
from pagedserve.scheduler_svc.metrics import SchedulerMetrics
from pagedserve.services.common.config import GiB
from pagedserve.services.common.sampling_params import SamplingParams
from prometheus_client import CollectorRegistry

from tests.integration.test_engine import (
    FlakyWorker,
    assert_all_blocks_free,
    generate,
    make_engine,
    prompts,
    restarting,
)

SAMPLING = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
NUM_GPU_BLOCKS = 16  # of 8 tokens
OFFLOAD_GIB = 0.01


def _workload() -> list[list[int]]:
    """Four 48-token prefixes (6 blocks each, 24 in all), each asked twice, round-robin."""
    prefixes = prompts(7, [48, 48, 48, 48])
    return [p + tail for round_seed in (1, 2)
            for p, tail in zip(prefixes, prompts(round_seed, [3, 3, 3, 3]), strict=True)]


def _run(engine, workload: list[list[int]]) -> list[list[int]]:
    return [generate(engine, [ids], SAMPLING)["r0"] for ids in workload]


def test_prefixes_past_the_device_cache_come_back_from_the_host(llama_dir):
    workload = _workload()
    without = make_engine(llama_dir, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                          enable_prefix_caching=True)
    expected = _run(without, workload)
    assert without.core.block_manager.prefix_cache_hits == 0  # every prefix was recomputed
    tiered = make_engine(llama_dir, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                         enable_prefix_caching=True, kv_offload_gib=OFFLOAD_GIB)
    assert _run(tiered, workload) == expected
    core = tiered.core
    bytes_per_block = core.workers[0].kv_spec.bytes_per_block
    assert core.num_offload_blocks == int(OFFLOAD_GIB * GiB // bytes_per_block)
    host = core.block_manager.host_tier
    # the second round hits all six blocks of each prefix, from the host: nothing without it
    assert host.num_hit_tokens == 4 * 48
    assert host.num_onloaded_blocks == 4 * 6 and host.num_offloaded_blocks >= 4 * 6
    assert core.block_manager.prefix_cache_hits == 4 * 48
    assert core.block_manager.num_free_cpu_blocks == core.num_cpu_blocks  # swap space untouched
    assert_all_blocks_free(tiered)


def test_the_tier_copies_are_metered_in_bytes_and_in_the_workers_time(llama_dir):
    engine = make_engine(llama_dir, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                         enable_prefix_caching=True, kv_offload_gib=OFFLOAD_GIB)
    registry = CollectorRegistry()
    engine.core.stat_loggers.append(SchedulerMetrics(registry, "m", lambda: None))
    _run(engine, _workload())
    host = engine.core.block_manager.host_tier
    bytes_per_block = engine.core.workers[0].kv_spec.bytes_per_block

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "m"})

    assert value("vllm:kv_offload_load_bytes_total") == host.num_onloaded_blocks * bytes_per_block
    assert value("vllm:kv_offload_store_bytes_total") == (host.num_offloaded_blocks
                                                          * bytes_per_block)
    # the CPU worker's copies take time it measures; none of it is a preemption swap's here
    assert value("vllm:kv_offload_load_time_total") > 0
    assert value("vllm:kv_offload_store_time_total") > 0


@pytest.mark.parametrize("restarts", [False, True], ids=["steady", "worker-restarts"])
def test_preemption_by_swap_and_worker_restarts_beside_the_tier(llama_dir, restarts):
    # test_engine's small pool: four sequences need 26 blocks of 8, 12 force swaps, and their
    # cached blocks keep moving to the host and back
    batch = prompts(0, [13, 29, 7, 21])
    expected = generate(make_engine(llama_dir, async_scheduling=False), batch)
    engine = make_engine(llama_dir, num_gpu_blocks_override=12, preemption_mode="swap",
                         enable_prefix_caching=True, kv_offload_gib=OFFLOAD_GIB)
    if restarts:
        first = engine.core.scheduler._step_id + 1
        restarting(engine, lambda plan: plan.step_id in (first + 5, first + 30))
    assert generate(engine, batch) == expected
    assert engine.get_load().num_preemptions > 0
    assert engine.core.block_manager.host_tier.num_offloaded_blocks > 0
    assert_all_blocks_free(engine)


def test_a_failed_step_with_tier_copies_leaves_no_wrong_kv_behind(llama_dir):
    workload = _workload()
    expected = _run(make_engine(llama_dir, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                                enable_prefix_caching=True), workload)
    engine = make_engine(llama_dir, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                         enable_prefix_caching=True, kv_offload_gib=OFFLOAD_GIB)
    assert _run(engine, workload[:4]) == expected[:4]
    core = engine.core
    # the step that would copy the first prefix back (and others out) never runs
    core.workers = [FlakyWorker(core.workers[0], fail_on_step=core.scheduler._step_id + 1)]
    engine.add_request("victim", workload[4], SAMPLING)
    reports = []
    while engine.has_unfinished_requests():
        reports += engine.step()
    assert reports[-1].finished and reports[-1].outputs[0].finish_reason == "error"
    assert _run(engine, workload[4:]) == expected[4:]
    assert_all_blocks_free(engine)


def test_prompts_waiting_for_blocks_take_those_of_requests_ending_in_the_step_in_flight(llama_dir):
    """All eight at once: two fit the device (seven blocks each of 16), the rest wait for a
    running one to end and go into its blocks in the step planned behind its last token's,
    copied back from the host there; greedy outputs are those of one request at a time."""
    workload = _workload()
    expected = _run(make_engine(llama_dir, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                                enable_prefix_caching=True), workload)
    engine = make_engine(llama_dir, num_gpu_blocks_override=NUM_GPU_BLOCKS,
                         enable_prefix_caching=True, kv_offload_gib=OFFLOAD_GIB)
    out = generate(engine, workload, SAMPLING)
    assert [out[f"r{i}"] for i in range(len(workload))] == expected
    assert engine.core.block_manager.host_tier.num_hit_tokens > 0
    assert_all_blocks_free(engine)
