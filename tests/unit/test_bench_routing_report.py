"""The routing bench's records: both comparisons name the workload and the caches alike."""

from __future__ import annotations

import argparse

from bench.routing_report import PolicyResult, summarize, summarize_kv_events
from bench.routing_workload import WORKLOAD_FLAGS, cache_blocks, preset_args


def _args(**given) -> argparse.Namespace:
    values = {name: None for name in WORKLOAD_FLAGS}
    values.update(quick=True, seed=0, min_token_id=3, max_token_id=300, cache_fraction=0.6,
                  kv_cache_memory_gib=0.0, restart_at=None)
    values.update(given)
    return preset_args(argparse.Namespace(**values), "chat")


def _result(policy: str, num_cached_tokens: int) -> PolicyResult:
    return PolicyResult(policy, num_requests=4, num_cached_tokens=num_cached_tokens,
                        num_output_tokens=40, elapsed_s=2.0, routing_us={"p50": 3.0},
                        num_reusable_tokens=160, num_shared_reusable_tokens=64)


def test_both_records_start_with_the_workload_and_its_caches():
    args = _args(restart_at=0.5)
    head = {"workload": "chat",
            "workload_args": {name: getattr(args, name) for name in WORKLOAD_FLAGS},
            "cache_blocks": cache_blocks(args)}
    _, policies = summarize(args, _result("affinity", 128), _result("round_robin", 64))
    line, kv_events = summarize_kv_events(args, _result("events", 96), _result("index", 64))
    assert list(policies)[:3] == list(kv_events)[:3] == list(head)
    assert {k: policies[k] for k in head} == {k: kv_events[k] for k in head} == head
    assert policies["hit_token_ratio"] == 2.0 and kv_events["hit_token_ratio"] == 1.5
    assert kv_events["restart_at"] == 0.5 and kv_events["summary"] == line
    assert "replica r0 restarted once 50% of the turns were answered" in line
