"""The in-process engine with a real worker on a tiny model under random workloads (hypothesis):
whatever the pool size, preemption mode, token budget, prefix caching and async scheduling, and
however often the worker restarts mid-generation, each request's greedy output is the one it
has alone on a roomy engine (or it ends with an error saying why), and every block comes back."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from pagedserve.services.common.sampling_params import SamplingParams

from tests.integration.test_engine import assert_all_blocks_free, make_engine, prompts, restarting

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llama_dir):
    """prompt → its greedy output on a roomy engine, one request at a time (cached)."""
    engine = make_engine(llama_dir, async_scheduling=False)
    cache: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int]) -> list[int]:
        if tuple(prompt) not in cache:
            engine.add_request("alone", prompt, GREEDY)
            tokens: list[int] = []
            while engine.has_unfinished_requests():
                for report in engine.step():
                    tokens += report.outputs[0].token_ids
            cache[tuple(prompt)] = tokens
        return cache[tuple(prompt)]

    return get


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(1, 40), min_size=1, max_size=5), seed=st.integers(0, 3),
       num_gpu_blocks=st.integers(8, 40), preemption_mode=st.sampled_from(["recompute", "swap"]),
       max_num_batched_tokens=st.sampled_from([16, 64]), enable_prefix_caching=st.booleans(),
       async_scheduling=st.booleans(), crashes=st.sets(st.integers(1, 30), max_size=3))
def test_outputs_do_not_depend_on_pool_budget_preemption_or_worker_restarts(
        llama_dir, alone, lengths, seed, num_gpu_blocks, preemption_mode,
        max_num_batched_tokens, enable_prefix_caching, async_scheduling, crashes):
    engine = make_engine(llama_dir, num_gpu_blocks_override=num_gpu_blocks,
                         preemption_mode=preemption_mode,
                         max_num_batched_tokens=max_num_batched_tokens,
                         enable_prefix_caching=enable_prefix_caching,
                         async_scheduling=async_scheduling)
    first = engine.core.scheduler._step_id
    restarting(engine, lambda plan: plan.step_id - first in crashes)
    batch = prompts(seed, lengths, prefix=[7] * 8)  # a shared prefix: prefix-cache hits
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    for i, ids in enumerate(batch):
        engine.add_request(f"r{i}", ids, GREEDY)
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for report in engine.step():
            tokens.setdefault(report.request_id, []).extend(report.outputs[0].token_ids)
            if report.finished and report.outputs[0].finish_reason == "error":
                errors[report.request_id] = report.outputs[0].error
    else:
        raise AssertionError("the engine did not finish")
    for i, ids in enumerate(batch):
        request_id = f"r{i}"
        if request_id in errors:  # only what the engine refuses to retry or cannot fit
            assert "times in a row" in errors[request_id] or "KV-cache" in errors[request_id]
        else:
            assert tokens[request_id] == alone(ids), request_id
    assert_all_blocks_free(engine)
