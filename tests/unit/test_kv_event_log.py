"""The scheduler's KV events: what the prefix cache stores, evicts and clears is published in
order; a reader resumes after the last event it applied, and one that fell out of the log or
knows another log (a restart) starts again from a snapshot of exactly what is held."""

from __future__ import annotations

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.kv_event_log import MAX_SNAPSHOT_BLOCKS, KVEventLog
from pagedserve.services.common.block_hash import hash_prompt_blocks
from pagedserve.services.common.kv_events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

BS = 4


def _manager(num_gpu_blocks: int = 8) -> BlockManager:
    return BlockManager(BS, num_gpu_blocks, 4, watermark=0.0, enable_prefix_caching=True)


def _run_and_free(bm: BlockManager, seq_id: int, token_ids: list[int]) -> None:
    bm.allocate(seq_id, token_ids)
    bm.mark_computed(seq_id, token_ids, len(token_ids))
    bm.free(seq_id)


def log_events(log: KVEventLog) -> list:
    return list(log.read(log.log_id, 0)[0].events)


def _apply(held: set[bytes], batches: list[KVEventBatch]) -> None:
    """What a gateway does with the events."""
    for batch in batches:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                held.clear()
            elif isinstance(event, BlockStored):
                held.update(event.block_hashes)
            else:
                held.difference_update(event.block_hashes)


def test_a_computed_prompt_is_one_stored_chain_and_eviction_removes_its_blocks():
    bm = _manager(num_gpu_blocks=4)
    log = bm.kv_events
    prompt = list(range(13))
    _run_and_free(bm, 1, prompt)
    hashes = hash_prompt_blocks(prompt, BS, 3)
    [batch] = log.read("", 0)
    assert batch.is_snapshot
    [stored] = log.read(log.log_id, 0)[0].events
    assert stored == BlockStored(tuple(hashes), None, BS, MEDIUM_GPU)
    assert stored.num_tokens == 12
    # a new prompt needs every block: the cached ones are evicted, least recently freed first
    bm.allocate(2, [99] * 16)
    events = log.read(log.log_id, 1)[0].events
    assert [e.block_hashes for e in events if isinstance(e, BlockRemoved)] == [
        (hashes[2],), (hashes[1],), (hashes[0],)]


def test_a_shared_prefix_is_stored_once_and_the_new_tail_names_its_parent():
    bm = _manager()
    shared = [1, 2, 3, 4, 5, 6, 7, 8]
    _run_and_free(bm, 1, [*shared, 9])
    _run_and_free(bm, 2, [*shared, 20, 21, 22, 23, 24])
    hashes = hash_prompt_blocks([*shared, 20, 21, 22, 23], BS, 3)
    events = log_events(bm.kv_events)
    assert events[-1] == BlockStored((hashes[2],), hashes[1], BS)


def test_resuming_after_a_sequence_gives_only_the_newer_events():
    log = KVEventLog(BS)
    log.stored([b"a", b"b"], None)
    [first] = log.read("", 0)
    log.removed([b"b"])
    log.stored([b"c"], b"a")
    [batch] = log.read(first.log_id, first.last_sequence)
    assert not batch.is_snapshot and batch.last_sequence == 3
    assert batch.events == (BlockRemoved((b"b",)), BlockStored((b"c",), b"a", BS))
    assert log.read(log.log_id, 3)[0].events == ()


def test_a_reader_that_fell_out_of_the_log_or_knows_another_log_gets_a_snapshot():
    log = KVEventLog(BS, max_events=2)
    held: set[bytes] = set()
    _apply(held, log.read("", 0))
    log.stored([b"a", b"b"], None)
    log.stored([b"x"], None)
    log.removed([b"b"])
    log.stored([b"c"], b"a")
    for log_id, last_sequence in ((log.log_id, 1), ("a restarted replica's", 4)):
        batches = log.read(log_id, last_sequence)
        assert batches[0].is_snapshot and batches[0].last_sequence == 4
        stale = {b"stale"}
        _apply(stale, batches)
        assert stale == {b"a", b"x", b"c"}


def test_a_snapshot_keeps_chains_and_parents_and_splits_into_bounded_batches():
    log = KVEventLog(BS)
    chain = [i.to_bytes(4, "little") for i in range(MAX_SNAPSHOT_BLOCKS + 10)]
    log.stored(chain, None)
    log.stored([b"tail"], chain[5])
    batches = log.read("", 0)
    assert [b.is_snapshot for b in batches] == [True, False]
    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    assert all(len(e.block_hashes) <= MAX_SNAPSHOT_BLOCKS for e in stored)
    assert [h for e in stored for h in e.block_hashes] == [*chain, b"tail"]
    assert stored[-1].parent_block_hash == chain[5]


def test_reset_prefix_cache_publishes_all_blocks_cleared():
    bm = _manager()
    _run_and_free(bm, 1, list(range(9)))
    bm.reset_prefix_cache()
    assert isinstance(log_events(bm.kv_events)[-1], AllBlocksCleared)
    held = {b"old"}
    _apply(held, bm.kv_events.read("", 0))
    assert held == set()
