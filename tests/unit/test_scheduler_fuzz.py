"""The scheduler under random workloads on small pools (hypothesis): whatever the policy,
preemption mode, budgets, prefix caching and sampling (greedy, n/best_of forks, beam search),
every request ends -- with its tokens, or with an error saying it can never fit -- within a
bounded number of steps, and every block comes back."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import assume, given, settings

from services.errors import InvalidRequest
from services.sampling_params import SamplingParams
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
       max_num_seqs=st.integers(2, 8), max_num_batched_tokens=st.integers(8, 64),
       requests=REQUESTS)
def test_every_request_ends_and_every_block_comes_back(
        num_gpu_blocks, num_cpu_blocks, block_size, policy, preemption_mode,
        enable_chunked_prefill, enable_prefix_caching, max_num_seqs, max_num_batched_tokens,
        requests):
    assume(max_num_batched_tokens >= max_num_seqs)
    h = Harness(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                policy=policy, preemption_mode=preemption_mode, max_num_seqs=max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                enable_chunked_prefill=enable_chunked_prefill)
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
    for step in range(600):
        for request_id, prompt_len, sampling, priority in arrivals.pop(step, []):
            h.add(request_id, prompt_len, sampling, priority)
        if not arrivals and not h.scheduler.has_unfinished():
            break
        for report in h.step()[1]:
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
            if output.finish_reason == "error":
                assert "KV-cache blocks" in output.error or "max_model_len" in output.error
            else:
                assert output.finish_reason == "length"
                assert len(tokens[request_id, output.index]) == group.sampling.max_tokens
    assert h.all_free()
