"""Prefill/decode disaggregation in the block manager: a prefill replica pins the blocks of a
prompt it computed (export), a decode replica reserves blocks for the ones its prefix cache lacks,
then adopts them (prefix cache, stored events) or, when the transfer failed, gives them back."""

from __future__ import annotations

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.prefix_cache import hash_prompt_blocks
from pagedserve.services.common.kv_events import BlockRemoved, BlockStored

BS = 4
PROMPT = list(range(100, 113))  # 3 full blocks and one token


def _manager(num_gpu_blocks: int = 8) -> BlockManager:
    return BlockManager(BS, num_gpu_blocks, 2, watermark=0.0, enable_prefix_caching=True)


def _compute(bm: BlockManager, seq_id: int, token_ids: list[int]) -> int:
    """The prompt runs and finishes; returns its cached tokens."""
    num_cached = bm.allocate(seq_id, token_ids)
    bm.mark_computed(seq_id, token_ids, len(token_ids))
    bm.free(seq_id)
    return num_cached


def _events(bm: BlockManager):
    return [e for batch in bm.kv_events.read(bm.kv_events.log_id, 0) for e in batch.events]


def test_an_export_pins_the_computed_blocks_until_unpinned():
    bm = _manager(4)
    _compute(bm, 1, PROMPT)
    pinned = bm.pin_prefix(PROMPT)
    assert len(pinned) == 3 and all(bm.gpu_pool.ref_counts[b] == 1 for b in pinned)
    assert bm.num_free_gpu_blocks == 1  # pinned blocks cannot be evicted
    bm.unpin(pinned)
    assert bm.num_free_gpu_blocks == 4
    assert _compute(bm, 2, PROMPT) == 3 * BS  # still cached after the pin


def test_an_export_stops_at_the_first_block_not_computed():
    bm = _manager()
    _compute(bm, 1, PROMPT[:2 * BS])
    assert len(bm.pin_prefix(PROMPT)) == 2
    assert bm.pin_prefix(list(range(500, 513))) == []


def test_an_adopted_import_is_a_prefix_hit_and_stored_events_name_it():
    bm = _manager()
    kv_import = bm.reserve_import(PROMPT, 3)
    assert kv_import is not None and len(kv_import.block_ids) == 3
    assert kv_import.block_hashes == hash_prompt_blocks(PROMPT, BS, 3)
    assert all(bm.gpu_pool.ref_counts[b] == 1 for b in kv_import.block_ids)
    assert bm.num_free_gpu_blocks == 5
    bm.adopt_import(kv_import)
    assert all(bm.gpu_pool.ref_counts[b] == 0 for b in kv_import.block_ids)
    assert bm.num_free_gpu_blocks == 8  # cached and evictable
    [stored] = [e for e in _events(bm) if isinstance(e, BlockStored)]
    assert list(stored.block_hashes) == kv_import.block_hashes and stored.parent_block_hash is None
    assert bm.allocate(7, PROMPT) == 3 * BS
    assert bm.block_table(7)[:3] == kv_import.block_ids


def test_an_import_reserves_only_the_blocks_the_cache_lacks():
    bm = _manager()
    _compute(bm, 1, PROMPT[:BS + 1])  # the first block is cached here already
    kv_import = bm.reserve_import(PROMPT, 3)
    assert kv_import is not None
    assert len(kv_import.held_block_ids) == 1 and len(kv_import.block_ids) == 2
    bm.adopt_import(kv_import)
    stored = [e for e in _events(bm) if isinstance(e, BlockStored)]
    assert list(stored[-1].block_hashes) == kv_import.block_hashes[1:]
    assert stored[-1].parent_block_hash == kv_import.block_hashes[0]
    assert bm.allocate(2, PROMPT) == 3 * BS


def test_nothing_is_reserved_for_a_prompt_cached_whole_or_a_full_cache():
    bm = _manager()
    _compute(bm, 1, PROMPT)
    assert bm.reserve_import(PROMPT, 3) is None
    assert all(bm.gpu_pool.ref_counts[b] == 0 for b in range(8))  # the held ones let go
    full = _manager(4)
    full.allocate(1, list(range(4 * BS)))
    assert full.reserve_import(PROMPT, 3) is None
    assert full.reserve_import(PROMPT, 0) is None


def test_a_cancelled_import_frees_its_blocks_unnamed():
    bm = _manager()
    kv_import = bm.reserve_import(PROMPT, 3)
    bm.cancel_import(kv_import)
    assert bm.num_free_gpu_blocks == 8 and bm.gpu_pool.num_free_blocks == 8
    assert not [e for e in _events(bm) if isinstance(e, BlockStored)]
    assert bm.allocate(1, PROMPT) == 0


def test_a_prefix_computed_during_the_transfer_keeps_its_block_and_the_copy_is_freed():
    bm = _manager()
    kv_import = bm.reserve_import(PROMPT, 3)
    _compute(bm, 1, PROMPT)  # the same prompt ran here meanwhile
    bm.adopt_import(kv_import)
    assert bm.gpu_pool.num_free_blocks == 8 - 3  # only the local copy stays cached
    assert all(bm.gpu_pool.is_free(b) for b in kv_import.block_ids)
    assert bm.allocate(2, PROMPT) == 3 * BS


def test_adopted_blocks_are_evicted_like_computed_ones():
    bm = _manager(4)
    kv_import = bm.reserve_import(PROMPT, 3)
    bm.adopt_import(kv_import)
    bm.allocate(1, list(range(500, 516)))  # needs every block
    removed = [e for e in _events(bm) if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted(kv_import.block_hashes)
    bm.free(1)
    assert bm.allocate(2, PROMPT) == 0
