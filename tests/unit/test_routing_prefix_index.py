"""Affinity routing by the gateway's prefix index: a chat's turns follow its history, the chats of
one system prompt spread over the replicas, and the index forgets what was routed longest ago."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.gateway.prefix_index import PrefixIndex, chained_block_hashes
from pagedserve.services.gateway.routing import Candidate, Decision, Reason, Router

BLOCK = 16


def idle(*addresses: str) -> list[Candidate]:
    return [Candidate(a, 0) for a in addresses]


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 300) for _ in range(n)]


def test_hashes_are_chained_over_whole_blocks():
    a = chained_block_hashes(list(range(3 * BLOCK + 5)), BLOCK, 10)
    b = chained_block_hashes([*range(BLOCK), 999, *range(BLOCK + 1, 3 * BLOCK)], BLOCK, 10)
    assert len(a) == 3 and a[0] == b[0] and a[1] != b[1] and a[2] != b[2]
    assert chained_block_hashes(list(range(3 * BLOCK)), BLOCK, 2) == a[:2]


def test_the_index_finds_branch_points_and_the_deepest_replica():
    index = PrefixIndex(100)
    system = [1, 2, 3]
    index.record([*system, 10, 11], "a")
    same_chat = index.match([*system, 10, 11, 12], frozenset({"a", "b"}))
    assert same_chat.num_blocks == 5 and same_chat.address == "a"
    assert same_chat.num_shared_blocks == 0
    new_chat = index.match([*system, 20], frozenset({"a", "b"}))
    assert (new_chat.num_blocks, new_chat.num_shared_blocks) == (3, 3)
    index.record([*system, 20, 21], "b")
    first_chat = index.match([*system, 10, 11, 12], frozenset({"a", "b"}))
    assert (first_chat.num_blocks, first_chat.address, first_chat.num_shared_blocks) == (5, "a", 3)
    assert index.match([*system, 10, 11], frozenset({"b"})).address == "b"


def test_the_index_forgets_the_least_recently_routed_first():
    index = PrefixIndex(4)
    index.record([1, 2], "a")
    index.record([3, 4], "b")
    index.record([1, 2], "a")
    index.record([5], "a")
    assert len(index) == 4  # of [3, 4], routed longest ago, its deepest block went
    assert index.match([3, 4], frozenset({"a", "b"})).num_blocks == 1
    assert index.match([1, 2], frozenset({"a", "b"})).num_blocks == 2


def test_the_index_forgets_a_prompts_deepest_blocks_first_as_replicas_evict():
    index = PrefixIndex(8)
    index.record([1, 2, 3, 4, 5, 6], "a")
    index.record([7, 8, 9], "b")  # 9 entries: the chat's last block goes, its head stays
    assert index.match([1, 2, 3, 4, 5, 6, 10], frozenset({"a", "b"})).num_blocks == 5
    index.record([11, 12, 13], "b")
    chat = index.match([1, 2, 3, 4, 5, 6, 10], frozenset({"a", "b"}))
    assert (chat.num_blocks, chat.address) == (2, "a") and len(index) == 8
    assert dict(index.num_blocks_by_address) == {"a": 2, "b": 6}


def test_a_chat_that_lost_its_tail_stays_on_its_replica():
    rng = random.Random(4)
    router = Router("affinity", 1.5, 4)
    replicas = [Candidate("a:1", 0, num_gpu_blocks=20), Candidate("b:1", 0, num_gpu_blocks=20)]
    system = tokens(rng, 4 * BLOCK)
    chat = [*system, *tokens(rng, 12 * BLOCK)]
    home = router.choose(replicas, chat, BLOCK).address
    for _ in range(3):  # other chats of the prompt: 46 blocks, past the caches' 40
        router.choose(replicas, [*system, *tokens(rng, 10 * BLOCK)], BLOCK)
    chat += tokens(rng, 3 * BLOCK)
    match = router.index.match(chained_block_hashes(chat, BLOCK, 64), frozenset({"a:1", "b:1"}))
    assert (match.address, match.num_shared_blocks) == (home, 4) and 4 < match.num_blocks < 16
    assert router.choose(replicas, chat, BLOCK) == Decision(home, Reason.AFFINITY)


def test_the_index_remembers_no_more_than_the_replicas_caches_hold():
    rng = random.Random(1)
    router = Router("affinity", 1.5, 4, index_blocks=1000)
    replicas = [Candidate("a:1", 0, num_gpu_blocks=20), Candidate("b:1", 0, num_gpu_blocks=30)]
    ended = [*tokens(rng, 8 * BLOCK), *tokens(rng, 30 * BLOCK)]
    router.choose(replicas, ended, BLOCK)
    for _ in range(6):  # other chats take the caches since: the ended one is evicted there too
        router.choose(replicas, tokens(rng, 10 * BLOCK), BLOCK)
    assert len(router.index) == 50
    assert router.index.match(chained_block_hashes(ended, BLOCK, 64),
                              frozenset({"a:1", "b:1"})).num_blocks == 0
    assert sum(router.index.num_blocks_by_address.values()) == 50
    unknown = [Candidate("a:1", 0, num_gpu_blocks=20), Candidate("b:1", 0)]
    for _ in range(6):  # a replica's cache not known yet: only the index's own bound
        router.choose(unknown, tokens(rng, 10 * BLOCK), BLOCK)
    assert len(router.index) == 110


def test_chats_of_one_system_prompt_spread_and_each_stays_on_its_replica():
    rng = random.Random(0)
    router = Router("affinity", 1.5, 4)
    replicas = idle("a:1", "b:1")
    system = tokens(rng, 8 * BLOCK)
    chats = [[*system, *tokens(rng, 4 * BLOCK)] for _ in range(40)]
    first = [router.choose(replicas, chat, BLOCK).address for chat in chats]
    for _ in range(3):  # the next turns: history, an answer, a new user message
        for i, chat in enumerate(chats):
            chat += tokens(rng, 6 * BLOCK + 3)
            decision = router.choose(replicas, chat, BLOCK)
            assert (decision.address, decision.reason) == (first[i], Reason.AFFINITY), i
    share = Counter(first)
    assert set(share) == {"a:1", "b:1"} and min(share.values()) >= 10, share


def test_a_chat_moved_off_an_overloaded_replica_follows_its_history_there():
    rng = random.Random(1)
    router = Router("affinity", 1.5, 4)
    chat = tokens(rng, 5 * BLOCK)
    home = router.choose(idle("a:1", "b:1"), chat, BLOCK).address
    other = "b:1" if home == "a:1" else "a:1"
    chat += tokens(rng, 2 * BLOCK)
    moved = router.choose([Candidate(home, 4), Candidate(other, 0)], chat, BLOCK)
    assert (moved.address, moved.reason) == (other, Reason.OVERLOADED)
    chat += tokens(rng, 2 * BLOCK)
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == other


def test_a_replica_gone_is_not_followed():
    router = Router("affinity", 1.5, 4)
    chat = list(range(3, 3 + 5 * BLOCK))
    home = router.choose(idle("a:1", "b:1"), chat, BLOCK).address
    survivor = "b:1" if home == "a:1" else "a:1"
    decision = router.choose(idle(survivor), [*chat, *range(3, 3 + BLOCK)], BLOCK)
    assert decision.address == survivor


def test_the_index_counts_the_blocks_each_replica_last_got():
    index = PrefixIndex(5)
    index.record([1, 2, 3], "a")
    index.record([1, 2, 4], "b")
    assert dict(index.num_blocks_by_address) == {"a": 1, "b": 3}
    index.record([7, 8, 9], "a")  # 7 entries: 3 and 4, the deepest routed longest ago, go
    assert len(index) == 5 and dict(index.num_blocks_by_address) == {"a": 3, "b": 2}
    assert index.match([1, 2, 4], frozenset({"a", "b"})).num_blocks == 2


def test_new_chats_of_a_shared_prompt_go_where_fewer_blocks_went():
    rng = random.Random(2)
    router = Router("affinity", 1.5, 4)
    system = tokens(rng, 4 * BLOCK)
    long_chat = [*system, *tokens(rng, 20 * BLOCK)]
    home = router.choose(idle("a:1", "b:1"), long_chat, BLOCK).address
    new_chat = [*system, *tokens(rng, 2 * BLOCK)]
    assert router.choose(idle("a:1", "b:1"), new_chat, BLOCK).address != home


def test_a_new_chat_joins_the_holder_of_its_shared_prompt_while_caches_are_even():
    rng = random.Random(3)
    router = Router("affinity", 1.5, 4)
    replicas = idle("a:1", "b:1")
    system = tokens(rng, 4 * BLOCK)
    home = router.choose(replicas, [*system, *tokens(rng, 8 * BLOCK)], BLOCK).address
    second = router.choose(replicas, [*system, *tokens(rng, 4 * BLOCK)], BLOCK).address
    assert second != home  # 12 blocks went to home, none elsewhere
    third = router.choose(replicas, [*system, *tokens(rng, 4 * BLOCK)], BLOCK).address
    assert third == second  # 8 blocks each: the system prompt's holder


def test_the_index_needs_room():
    with pytest.raises(ConfigError, match="routing_index_blocks must be >= 1, got 0"):
        RoutingConfig(routing_index_blocks=0)
