"""Routing decisions: prefix affinity on a consistent-hash ring, bounded by load; least loaded;
round robin; and the replica set's resolution of scheduler addresses."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.gateway.config import GatewayConfig, scheduler_targets
from pagedserve.services.gateway.replica_set import replica_addresses, resolve_target
from pagedserve.services.gateway.routing import (
    Candidate,
    Decision,
    HashRing,
    Reason,
    Router,
    prefix_key,
)

BLOCK = 16


def idle(*addresses: str) -> list[Candidate]:
    return [Candidate(a, 0) for a in addresses]


def test_the_key_is_the_first_full_blocks_only():
    shared = list(range(3, 3 + 4 * BLOCK))
    assert prefix_key(shared + [9, 9], BLOCK, 4) == prefix_key(shared + [7] * 40, BLOCK, 4)
    assert prefix_key(shared, BLOCK, 4) != prefix_key([1, *shared[1:]], BLOCK, 4)
    assert prefix_key(list(range(BLOCK - 1)), BLOCK, 4) is None


def test_a_shared_prefix_picks_one_replica_and_different_ones_spread():
    router = Router("affinity", 1.5, 4)
    replicas = idle("a:1", "b:1", "c:1")
    picks = {router.choose(replicas, [p] * (2 * BLOCK) + [i], BLOCK).address
             for p in [5] for i in range(20)}
    assert len(picks) == 1
    spread = Counter(router.choose(replicas, [p] * (2 * BLOCK), BLOCK).address
                     for p in range(300))
    assert set(spread) == {"a:1", "b:1", "c:1"} and min(spread.values()) > 50, spread


def test_a_replica_leaving_moves_only_its_own_keys():
    keys = [prefix_key([k] * BLOCK, BLOCK, 1) for k in range(500)]
    before = HashRing(["a", "b", "c"])
    after = HashRing(["a", "b"])
    moved = [k for k in keys if before.lookup(k) != after.lookup(k)]
    assert moved and all(before.lookup(k) == "c" for k in moved)


def test_an_overloaded_preferred_replica_yields_to_the_least_loaded():
    router = Router("affinity", 1.5, 4)
    prompt = [5] * (2 * BLOCK)
    preferred = router.choose(idle("a:1", "b:1"), prompt, BLOCK).address
    other = "b:1" if preferred == "a:1" else "a:1"
    loads = [Candidate(preferred, 2), Candidate(other, 0)]
    assert router.choose(loads, prompt, BLOCK).reason == Reason.AFFINITY  # 3 <= ceil(2.25)
    loads = [Candidate(preferred, 3), Candidate(other, 0)]
    assert router.choose(loads, prompt, BLOCK) == Decision(other, Reason.OVERLOADED)


def test_short_prompts_least_loaded_and_round_robin():
    loads = [Candidate("a:1", 4), Candidate("b:1", 1), Candidate("c:1", 1)]
    short = Router("affinity", 1.5, 4).choose(loads, [1, 2, 3], BLOCK)
    assert short.reason == Reason.SHORT_PROMPT and short.address in {"b:1", "c:1"}
    least = Router("least-loaded", 1.5, 4)
    assert {least.choose(loads, [], BLOCK).address for _ in range(4)} == {"b:1", "c:1"}
    turns = Router("round-robin", 1.5, 4)
    assert [turns.choose(loads, [], BLOCK).address for _ in range(4)] == [
        "a:1", "b:1", "c:1", "a:1"]


def test_scheduler_address_takes_several_targets():
    assert scheduler_targets("a:1, b:2,a:1,,") == ["a:1", "b:2"]
    assert GatewayConfig(scheduler_address="a:1,b:2").scheduler_address == "a:1,b:2"
    with pytest.raises(ConfigError, match="scheduler_address must be comma-separated"):
        GatewayConfig(scheduler_address="a:1,b")


def test_resolution_keeps_ips_and_single_addresses_as_they_are():
    async def main():
        return (await resolve_target("127.0.0.1:50052"), await resolve_target("[::1]:7"),
                await resolve_target("localhost:9"))

    ip, ipv6, name = asyncio.run(main())
    assert ip == {"127.0.0.1:50052": ""} and ipv6 == {"[::1]:7": ""}
    assert name == {"localhost:9": ""}


def test_a_name_with_several_addresses_is_a_replica_per_address_of_both_families():
    both = replica_addresses("engine.svc:50052", ["10.0.0.1", "fd00::2", "10.0.0.3", "fd00::2"])
    assert both == {"10.0.0.1:50052": "engine.svc", "[fd00::2]:50052": "engine.svc",
                    "10.0.0.3:50052": "engine.svc"}
    assert replica_addresses("engine:1", ["fd00::1", "fd00::2"]) == {
        "[fd00::1]:1": "engine", "[fd00::2]:1": "engine"}
    assert replica_addresses("localhost:9", ["127.0.0.1", "::1"]) == {"localhost:9": ""}
    assert replica_addresses("one:9", ["10.0.0.1"]) == {"one:9": ""}
