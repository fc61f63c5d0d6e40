"""The routing bench's records: both comparisons name the workload and the caches alike."""

from __future__ import annotations

import argparse

from bench.routing import num_leading
from bench.routing_report import (
    PolicyResult,
    count_miss_timing,
    summarize,
    summarize_arm,
    summarize_kv_events,
)
from bench.routing_workload import (
    BLOCK_SIZE,
    WORKLOAD_FLAGS,
    Conversation,
    cache_blocks,
    end_turn,
    next_prompt,
    preset_args,
)


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


def test_the_kv_events_line_names_each_arm_and_its_turns_and_preemptions_per_replica():
    first, second = _result("index", 96), _result("index again", 64)
    first.replica_turns, first.replica_preemptions = [17, 10], [3, 0]
    second.replica_turns, second.replica_preemptions = [14, 13], [0, 0]
    line, record = summarize_kv_events(_args(), first, second)
    assert line.startswith("routing chat: own index 96 hit tokens")
    assert "; index again 64 (" in line and "x1.50" in line
    assert "turns per replica (r0, r1): own index [17, 10], index again [14, 13]" in line
    assert "preemptions: own index [3, 0], index again [0, 0]" in line
    assert record["policies"][0].replica_turns == [17, 10]


def test_an_arm_run_alone_has_the_workload_head_and_its_own_line():
    result = _result("kv-events", 96)
    result.replica_turns, result.replica_preemptions = [14, 13], [0, 1]
    line, record = summarize_arm(_args(), result)
    assert line.startswith("routing chat, KV events alone: 96 hit tokens (60% of the reusable)")
    assert "turns per replica (r0, r1) [14, 13]; preemptions [0, 1]" in line
    assert record["workload"] == "chat" and record["policies"] == [result]
    assert record["summary"] == line


def test_a_later_turns_misses_are_split_by_when_its_replica_lost_them():
    conversation = Conversation(list(range(2 * BLOCK_SIZE)), [[7] * BLOCK_SIZE] * 3)
    result = PolicyResult("kv-events")
    first = next_prompt(conversation, set())
    count_miss_timing(result, conversation, first, 0, 0, 0)
    assert result.missed_when == {}  # a first turn has no history to lose
    end_turn(conversation, [9] * BLOCK_SIZE, "r0")
    prompt = next_prompt(conversation, set())
    reusable_blocks = (4 * BLOCK_SIZE - 1) // BLOCK_SIZE  # the answer's last token has no KV
    count_miss_timing(result, conversation, prompt, 3 * BLOCK_SIZE, 3, 3)
    assert result.belief_error_blocks == {}  # the events saw the cache as it was
    # routed while its replica held 2 of its 3 reusable blocks (the events said 3), 1 hit
    count_miss_timing(result, conversation, prompt, BLOCK_SIZE, 2, 3)
    assert result.missed_when == {"before_routing": (reusable_blocks - 2) * BLOCK_SIZE,
                                  "after_routing": BLOCK_SIZE}
    assert result.belief_error_blocks == {"over": 1}
    count_miss_timing(result, conversation, prompt, 3 * BLOCK_SIZE, 3, 1)
    assert result.belief_error_blocks == {"over": 1, "under": 2}
    line, _ = summarize_arm(_args(), result)
    assert f"missed when {result.missed_when}" in line and "{'over': 1, 'under': 2}" in line


def test_leading_blocks_stop_at_the_first_one_not_held():
    held = {b"a", b"b", b"d"}
    assert num_leading([b"a", b"b", b"c", b"d"], held.__contains__) == 2
    assert num_leading([b"a", b"b"], held.__contains__) == 2
    assert num_leading([b"c", b"a"], held.__contains__) == 0
