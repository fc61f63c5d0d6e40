"""Affinity on KV events: the router prefers the replica that really holds the most of a prompt's
leading blocks (a host-memory block counting less than a GPU one), forgets a replica whose event
stream broke until it resumes, and replaces what a restarted replica held by its snapshot."""

from __future__ import annotations

import pytest
from pagedserve.services.common.block_hash import hash_prompt_blocks
from pagedserve.services.common.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WatchKVEventsRequest,
)
from pagedserve.services.gateway.routing import Candidate, Decision, Reason, Router

BLOCK = 16


def idle(*addresses: str) -> list[Candidate]:
    return [Candidate(a, 0) for a in addresses]


def prompt(seed: int, num_blocks: int) -> list[int]:
    return [(seed * 31 + i) % 500 + 3 for i in range(num_blocks * BLOCK)] + [1]


def holds(router: Router, address: str, token_ids: list[int], num_blocks: int,
          medium: str = "GPU", log_id: str = "log", sequence: int = 1) -> None:
    hashes = tuple(hash_prompt_blocks(token_ids, BLOCK, num_blocks))
    router.kv_index.apply(address, KVEventBatch(
        log_id, sequence, (AllBlocksCleared(), BlockStored(hashes, None, BLOCK, medium)),
        is_snapshot=True))


def test_the_replica_holding_the_longest_prefix_wins_over_the_ring_and_the_history():
    router = Router("affinity", 1.5, 4)
    chat = prompt(1, 8)
    first = router.choose(idle("a:1", "b:1"), chat, BLOCK).address
    other = "b:1" if first == "a:1" else "a:1"
    holds(router, first, chat, 2)
    holds(router, other, chat, 6)  # e.g. another gateway sent this chat there
    decision = router.choose(idle("a:1", "b:1"), chat, BLOCK)
    assert decision == Decision(other, Reason.HELD_BLOCKS)


def test_a_host_memory_block_counts_less_than_a_gpu_block():
    router = Router("affinity", 1.5, 4, offload_weight=0.5)
    chat = prompt(2, 8)
    holds(router, "a:1", chat, 3)
    holds(router, "b:1", chat, 5, medium=MEDIUM_CPU)  # 2.5 against 3
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == "a:1"
    holds(router, "b:1", chat, 8, medium=MEDIUM_CPU)  # 4 against 3
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == "b:1"


def test_a_replica_whose_stream_broke_is_forgotten_until_it_resumes():
    router = Router("affinity", 1.5, 4)
    chat = prompt(3, 8)
    holds(router, "a:1", chat, 2)
    holds(router, "b:1", chat, 6)
    router.kv_index.mark_lost("b:1")
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == "a:1"
    assert router.kv_index.resume_point("b:1") == WatchKVEventsRequest("log", 1)
    router.kv_index.apply("b:1", KVEventBatch("log", 2, ()))  # resumed, nothing new
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == "b:1"


def test_a_restarted_replica_is_known_by_its_snapshot_only():
    router = Router("affinity", 1.5, 4)
    chat = prompt(4, 8)
    holds(router, "a:1", chat, 2)
    holds(router, "b:1", chat, 6)
    holds(router, "b:1", prompt(9, 2), 2, log_id="after restart")
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == "a:1"
    with pytest.raises(ValueError, match="without a snapshot"):
        router.kv_index.apply("b:1", KVEventBatch("yet another", 1, ()))


def test_removed_blocks_no_longer_count_and_without_events_the_history_decides():
    router = Router("affinity", 1.5, 4, use_kv_events=False)
    chat = prompt(5, 8)
    first = router.choose(idle("a:1", "b:1"), chat, BLOCK).address
    other = "b:1" if first == "a:1" else "a:1"
    holds(router, other, chat, 6)
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == first
    router.use_kv_events = True
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == other
    hashes = tuple(hash_prompt_blocks(chat, BLOCK, 6))
    router.kv_index.apply(other, KVEventBatch("log", 2, (BlockRemoved(hashes),)))
    holds(router, first, chat, 1)
    assert router.choose(idle("a:1", "b:1"), chat, BLOCK).address == first


def test_affinity_on_held_blocks_still_yields_to_the_load_bound():
    router = Router("affinity", 1.5, 4)
    chat = prompt(6, 8)
    router.choose([Candidate("c:1", 0)], chat, BLOCK)  # the memory's guess: c
    holds(router, "a:1", chat, 6)
    loaded = [Candidate("a:1", 10), Candidate("b:1", 0), Candidate("c:1", 10), Candidate("d:1", 1)]
    assert router.choose(loaded, chat, BLOCK) == Decision("b:1", Reason.OVERLOADED)


def test_new_chats_of_a_prefix_one_replica_holds_still_spread():
    router = Router("affinity", 1.5, 4)
    system = prompt(7, 4)[:-1]
    replicas = idle("a:1", "b:1")
    for i in range(6):  # the gateway learns the system prompt as a branch point
        router.choose(replicas, [*system, *prompt(100 + i, 2)], BLOCK)
    holds(router, "a:1", system, 4)
    holds(router, "b:1", [], 0)
    picks = {router.choose(replicas, [*system, *prompt(200 + i, 2)], BLOCK).address
             for i in range(8)}
    assert picks == {"a:1", "b:1"}


def test_held_blocks_do_not_draw_a_chat_to_a_busier_replica_than_the_guess():
    """Blocks the gateway's memory lacks are often the oldest their replica holds: a busier
    replica would evict them for the turns queued ahead before admitting this one."""
    router = Router("affinity", 1.5, 4)
    chat = prompt(9, 8)
    guess = router.choose(idle("a:1", "b:1"), chat, BLOCK).address
    other = "b:1" if guess == "a:1" else "a:1"
    holds(router, other, chat, 6)
    busier = [Candidate(guess, 1), Candidate(other, 2)]
    assert router.choose(busier, chat, BLOCK) == Decision(guess, Reason.AFFINITY)
    as_busy = [Candidate(guess, 2), Candidate(other, 2)]
    assert router.choose(as_busy, chat, BLOCK) == Decision(other, Reason.HELD_BLOCKS)
