"""The scheduler under random workloads on small pools (hypothesis): whatever the policy,
preemption mode, budgets, prefix caching (with or without a host tier), sampling (greedy, n/best_of forks, beam search) and
async scheduling (as EngineCore does: two steps in flight between engine steps, the next one
scheduled once a step's tokens are in and before its reports are built) and
pauses (backpressure: a paused group is never scheduled), every request ends -- with its tokens,
with an error saying it can never fit, or aborted between two steps -- within a bounded number
of steps, and every block comes back."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import assume, given, settings
from pagedserve.scheduler_svc.outputs import make_request_output
from pagedserve.scheduler_svc.step_window import SentStep, StepWindow
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams

from tests.unit.test_scheduler import Harness

KINDS = {
    "greedy": dict(temperature=0.0),
    "n2": dict(n=2, best_of=3, temperature=1.0, seed=1),
    "beam": dict(n=2, best_of=2, use_beam_search=True, temperature=0.0),
}
REQUESTS = st.lists(st.tuples(st.integers(1, 30),  # prompt length
                              st.sampled_from(sorted(KINDS)),
                              st.integers(1, 12),  # max_tokens
                              st.integers(0, 3),  # priority
                              st.integers(0, 6)),  # step it arrives at
                    min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(num_gpu_blocks=st.integers(4, 24), num_cpu_blocks=st.integers(0, 16),
       block_size=st.sampled_from([2, 4, 8]), policy=st.sampled_from(["fcfs", "priority"]),
       preemption_mode=st.sampled_from(["auto", "swap", "recompute"]),
       enable_chunked_prefill=st.booleans(), enable_prefix_caching=st.booleans(),
       num_offload_blocks=st.integers(0, 8),
       max_num_seqs=st.integers(2, 8), max_num_batched_tokens=st.integers(8, 64),
       async_scheduling=st.booleans(), requests=REQUESTS,
       aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=3),
       pauses=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 20), st.integers(0, 7)),
                       max_size=3),
       long_prefill_token_threshold=st.sampled_from([0, 2, 5, 12]),
       max_long_partial_prefills=st.integers(1, 2))
def test_every_request_ends_and_every_block_comes_back(
        num_gpu_blocks, num_cpu_blocks, block_size, policy, preemption_mode,
        enable_chunked_prefill, enable_prefix_caching, num_offload_blocks, max_num_seqs,
        max_num_batched_tokens, async_scheduling, requests, aborts, pauses, long_prefill_token_threshold,
        max_long_partial_prefills):
    assume(max_num_batched_tokens >= max_num_seqs)
    h = Harness(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                num_offload_blocks=num_offload_blocks,
                policy=policy, preemption_mode=preemption_mode, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill,
                long_prefill_token_threshold=long_prefill_token_threshold,
                max_long_partial_prefills=max_long_partial_prefills)
    arrivals: dict[int, list[tuple[str, int, SamplingParams, int]]] = {}
    for i, (prompt_len, kind, max_tokens, priority, at) in enumerate(requests):
        try:
            sampling = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **KINDS[kind])
            sampling.verify_for_model(vocab_size=1000)
        except InvalidRequest:
            continue
        if sampling.num_candidates > max_num_seqs:  # EngineCore.add_request refuses those
            continue
        arrivals.setdefault(at, []).append((f"r{i}", prompt_len, sampling, priority))
    assume(arrivals)
    finished, tokens = {}, {}
    window = StepWindow(async_scheduling)
    for step in range(600):
        for request_id, prompt_len, sampling, priority in arrivals.pop(step, []):
            h.add(request_id, prompt_len, sampling, priority)
        for at, index in aborts:  # as EngineCore.abort_request does
            group = h.groups.get(f"r{index}")
            if at == step and group is not None and not group.is_finished:
                h.scheduler.finish_group(group, "abort")
                finished[group.request_id] = make_request_output(group)
        for at, num_steps, index in pauses:  # as EngineCore.pause_request / resume_request do
            group = h.groups.get(f"r{index}")
            if group is not None and step in (at, at + num_steps):
                group.is_paused = step == at
        if not arrivals and not h.scheduler.has_unfinished() and not window:
            break
        reports = engine_step(h, window)
        for report in reports:
            for output in report.outputs:  # streamed groups report deltas
                tokens.setdefault((report.request_id, output.index), []).extend(
                    output.token_ids)
            if report.finished:
                finished[report.request_id] = report
    else:
        raise AssertionError(f"stalled: waiting {len(h.scheduler.waiting)}, running "
                             f"{len(h.scheduler.running)}, swapped {len(h.scheduler.swapped)}")
    assert set(finished) == set(h.groups)
    for request_id, report in finished.items():
        group = h.groups[request_id]
        for output in report.outputs:
            if output.finish_reason == "abort":
                continue
            if output.finish_reason == "error":
                assert "KV-cache blocks" in output.error or "max_model_len" in output.error
            else:
                assert output.finish_reason == "length"
                assert len(tokens[request_id, output.index]) == group.sampling.max_tokens
    assert h.all_free()


def engine_step(h: Harness, window: StepWindow) -> list:
    """EngineCore.step with the harness as the worker: its reports."""
    reports = []

    def send() -> SentStep | None:
        out = h.scheduler.schedule()
        assert not any(item.group.is_paused for item in out.scheduled)
        reports.extend(r for g in out.rejected if (r := make_request_output(g)) is not None)
        return None if out.plan is None else SentStep(out, [])

    window.fill(send)
    step = window.pop_oldest()
    if step is not None:
        groups = h.take_in(step)
        window.send_behind(send)
        reports += h.processor.report(groups)
    return reports
