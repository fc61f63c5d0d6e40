"""The routing replay: its model of a replica's prefix cache, and the real Router over it."""

from __future__ import annotations

import argparse

from bench.routing_replay import CacheModel, replay
from bench.routing_workload import WORKLOAD_FLAGS, make_conversations, preset_args


def _args(**given) -> argparse.Namespace:
    values = dict.fromkeys(WORKLOAD_FLAGS)
    values.update(quick=False, seed=0, min_token_id=3, max_token_id=300, cache_fraction=0.6,
                  kv_cache_memory_gib=0.0, routing_prefix_blocks=4,
                  routing_max_imbalance=1.5)
    values.update(given)
    return preset_args(argparse.Namespace(**values), "agent")


def test_the_cache_model_hits_cached_prefixes_and_evicts_tails_first():
    cache = CacheModel(8)
    first = [1, 2, 3, 4, 5]
    assert cache.admit(first, 6, 5) == 0
    cache.finish(first, 5, 6)
    assert cache.admit([1, 2, 9], 3, 3) == 2  # the hit stops where the prefix does
    cache.finish([1, 2, 9], 3, 3)
    # 6 cached blocks; a new 5-block turn needs 3 of them: 5, 4, then 3 of `first` go (9 is newer)
    assert cache.admit([20, 21, 22, 23], 5, 4) == 0
    cache.finish([20, 21, 22, 23], 4, 5)
    assert cache.admit([1, 2, 3, 4, 5], 6, 5) == 2


def test_affinity_hits_more_than_round_robin_under_cache_pressure_and_all_without_it():
    tight = _args()  # the preset: caches of 0.6 of its footprint
    affinity, round_robin = replay("affinity", tight, 0), replay("round-robin", tight, 1)
    num_turns = sum(len(c.user_turns) for c in make_conversations(tight, 0))
    assert affinity.num_requests == round_robin.num_requests == num_turns
    assert affinity.hit_share > round_robin.hit_share + 0.2, (affinity, round_robin)
    small = dict(num_conversations=8, num_open=4, num_turns=4, concurrency=4)
    roomy = _args(**small, cache_fraction=3.0)
    assert replay("affinity", roomy, 0).hit_share == 1.0
    # round robin only misses what a moved turn's history gained since its last visit there
    assert replay("round-robin", roomy, 1).missed_tokens.get("same_replica") == 0


def test_a_restart_fails_over_the_running_turns_and_loses_what_the_replica_held():
    # seed 2: r0 runs two turns when it restarts
    small = _args(num_conversations=8, num_open=4, num_turns=4, concurrency=4, seed=2)
    num_turns = sum(len(c.user_turns) for c in make_conversations(small, 0))
    steady = replay("affinity", small, 0)
    restarted = replay("affinity", small, 0, restart_at=0.5)
    assert restarted.num_requests == steady.num_requests == num_turns
    assert restarted.num_cached_tokens < steady.num_cached_tokens
    assert sum(steady.decisions.values()) == num_turns
    assert sum(restarted.decisions.values()) > num_turns  # r0's running turns routed again
    # with the events, the router forgets r0 at once and still answers every turn
    events = replay("affinity", small, 0, use_kv_events=True, restart_at=0.5)
    assert events.num_requests == num_turns
