"""Prefix caching in the BlockManager: reuse of computed full blocks, chained hashes, LRU eviction,
hit-rate counters, and the rule that at least one prompt token is always computed."""

from __future__ import annotations

from pagedserve.scheduler_svc.block_manager import AllocStatus, BlockManager
from pagedserve.scheduler_svc.prefix_cache import PrefixCache, hash_block_tokens

BS = 4


def _manager(num_gpu_blocks: int = 16, num_cpu_blocks: int = 8) -> BlockManager:
    return BlockManager(BS, num_gpu_blocks, num_cpu_blocks, watermark=0.0,
                        enable_prefix_caching=True)


def _run_prompt(bm: BlockManager, seq_id: int, token_ids: list[int]) -> int:
    """Allocate and compute a whole prompt, as a finished prefill would."""
    num_cached = bm.allocate(seq_id, token_ids)
    bm.mark_computed(seq_id, token_ids, len(token_ids))
    return num_cached


def test_shared_prefix_reuses_the_same_physical_blocks():
    bm = _manager()
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    b = [1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44]
    assert _run_prompt(bm, 1, a) == 0
    assert bm.allocate(2, b) == 2 * BS
    assert bm.block_table(2)[:2] == bm.block_table(1)[:2]
    assert bm.block_table(2)[2] != bm.block_table(1)[2]
    assert all(bm.gpu_pool.ref_counts[blk] == 2 for blk in bm.block_table(1)[:2])
    assert bm.num_free_gpu_blocks == 16 - 3 - 1


def test_only_computed_full_blocks_are_reused():
    bm = _manager()
    a = list(range(10))
    bm.allocate(1, a)
    assert bm.allocate(2, a) == 0  # nothing computed yet
    bm.mark_computed(1, a, 7)  # one full block computed
    assert bm.allocate(3, a) == BS
    bm.mark_computed(1, a, 10)
    assert bm.allocate(4, a) == 2 * BS


def test_never_the_whole_prompt_is_cached():
    bm = _manager()
    a = list(range(8))
    _run_prompt(bm, 1, a)
    # an exact full-block hit leaves the last block to compute, in a block of its own
    assert bm.allocate(2, a) == BS
    assert bm.block_table(2)[0] == bm.block_table(1)[0]
    assert bm.block_table(2)[1] != bm.block_table(1)[1]
    assert bm.allocate(3, a + [99]) == 2 * BS
    assert bm.allocate(4, a[:BS]) == 0


def test_hashes_chain_over_the_whole_prefix():
    bm = _manager()
    _run_prompt(bm, 1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    # the same second block after a different first block is a different prefix
    assert bm.allocate(2, [0, 0, 0, 0, 5, 6, 7, 8, 9]) == 0
    assert hash_block_tokens(None, [5, 6, 7, 8]) != hash_block_tokens(
        hash_block_tokens(None, [1, 2, 3, 4]), [5, 6, 7, 8])


def test_freed_cached_blocks_count_as_free_and_are_reused():
    bm = _manager(num_gpu_blocks=4)
    a = list(range(9))
    _run_prompt(bm, 1, a)
    cached = bm.block_table(1)[:2]
    bm.free(1)
    assert bm.num_free_gpu_blocks == 4
    assert bm.prefix_cache.num_evictable_blocks == 2
    assert bm.allocate(2, a) == 2 * BS
    assert bm.block_table(2)[:2] == cached
    assert bm.prefix_cache.num_evictable_blocks == 0
    assert all(bm.gpu_pool.ref_counts[blk] == 1 for blk in cached)


def test_free_list_first_then_least_recently_released_cached_block():
    bm = _manager(num_gpu_blocks=6)
    prompts = {1: [1] * BS + [0], 2: [2] * BS + [0], 3: [3] * BS + [0]}
    for seq_id, token_ids in prompts.items():
        _run_prompt(bm, seq_id, token_ids)
    cached = {seq_id: bm.block_table(seq_id)[0] for seq_id in prompts}
    for seq_id in (1, 3, 2):  # release order = LRU order
        bm.free(seq_id)
    assert bm.gpu_pool.num_free_blocks == 3 and bm.num_free_gpu_blocks == 6
    # three blocks from the free list, then the least recently released cached block: seq 1's
    bm.allocate(4, list(range(100, 116)))
    assert cached[1] in bm.block_table(4)
    assert cached[2] not in bm.block_table(4) and cached[3] not in bm.block_table(4)
    assert bm.prefix_cache.lookup(hash_block_tokens(None, [1] * BS)) is None
    bm.free(4)
    assert bm.allocate(5, prompts[1]) == 0
    assert bm.allocate(6, prompts[3]) == BS
    assert bm.block_table(6)[0] == cached[3]


def test_reuse_refreshes_recency():
    bm = _manager(num_gpu_blocks=4)
    first, second = [1] * BS + [0], [2] * BS + [0]
    _run_prompt(bm, 1, first)
    _run_prompt(bm, 2, second)
    bm.free(1)
    bm.free(2)
    assert bm.allocate(3, first) == BS  # first's block is reused, then released again: now newest
    bm.free(3)
    bm.allocate(4, list(range(100, 112)))  # two free-list blocks, then one eviction: second's
    bm.free(4)
    assert bm.allocate(5, first) == BS
    assert bm.allocate(6, second) == 0


def test_tail_blocks_are_evicted_before_the_blocks_they_chain_on():
    bm = _manager(num_gpu_blocks=4)
    a = list(range(12)) + [0]
    _run_prompt(bm, 1, a)
    first, second, third = bm.block_table(1)[:3]
    bm.free(1)
    bm.allocate(2, list(range(100, 108)))  # free-list block, then one eviction
    assert third in bm.block_table(2)
    bm.free(2)
    assert bm.allocate(3, a) == 2 * BS
    assert bm.block_table(3)[:2] == [first, second]


def test_hit_rate_counts_tokens():
    bm = _manager()
    assert bm.prefix_cache_hit_rate == 0.0
    _run_prompt(bm, 1, list(range(10)))
    bm.allocate(2, list(range(8)) + [50, 51])
    assert bm.prefix_cache_queries == 20
    assert bm.prefix_cache_hits == 8
    assert bm.prefix_cache_hit_rate == 0.4
    bm.can_allocate(list(range(10)))  # a probe is not a query
    assert bm.prefix_cache_queries == 20


def test_disabled_prefix_caching_never_hits():
    bm = BlockManager(BS, 16, 8, watermark=0.0)
    assert _run_prompt(bm, 1, list(range(10))) == 0
    assert bm.allocate(2, list(range(10))) == 0
    assert bm.block_table(1)[0] != bm.block_table(2)[0]
    assert bm.prefix_cache_queries == 0 and bm.prefix_cache_hit_rate == 0.0


def test_can_allocate_counts_hits_on_referenced_blocks_as_free_of_charge():
    bm = _manager(num_gpu_blocks=4)
    a = list(range(9))
    _run_prompt(bm, 1, a)  # 3 blocks, 1 free
    assert bm.can_allocate(list(range(100, 109))) is AllocStatus.LATER
    assert bm.can_allocate(a) is AllocStatus.OK  # two shared blocks + one new
    bm.allocate(2, a)
    assert bm.num_free_gpu_blocks == 0


def test_can_allocate_charges_hits_on_evictable_blocks():
    bm = _manager(num_gpu_blocks=4)
    a = list(range(9))
    _run_prompt(bm, 1, a)
    bm.free(1)
    bm.allocate(2, list(range(100, 105)))  # takes the 2 free-list blocks; 2 evictable remain
    assert bm.num_free_gpu_blocks == 2
    assert bm.can_allocate(a) is AllocStatus.LATER  # 2 evictable hits + 1 new block > 2
    assert bm.can_allocate(a[:8] + [7]) is AllocStatus.LATER
    assert bm.can_allocate(a[:5]) is AllocStatus.OK  # 1 evictable hit + 1 new block


def test_swap_out_keeps_the_gpu_original_cached_and_swap_in_reregisters():
    bm = _manager(num_gpu_blocks=4, num_cpu_blocks=4)
    a = list(range(9))
    _run_prompt(bm, 1, a)
    bm.swap_out([1])
    # the GPU copies are unreferenced but still cached (evictable); the CPU copies are not cached
    assert bm.num_free_gpu_blocks == 4 and bm.prefix_cache.num_evictable_blocks == 2
    bm.allocate(2, list(range(100, 116)))  # evicts both cached blocks
    assert bm.prefix_cache.num_cached_blocks == 0
    bm.free(2)
    bm.swap_in([1])
    assert bm.allocate(3, a) == 2 * BS
    assert bm.block_table(3)[:2] == bm.block_table(1)[:2]


def test_register_keeps_the_first_block_for_a_hash():
    cache = PrefixCache()
    h = hash_block_tokens(None, [1, 2, 3, 4])
    assert cache.register(5, h)
    assert not cache.register(6, h)
    assert cache.lookup(h) == 5 and not cache.is_cached(6)


def test_reset_forgets_every_cached_block_and_frees_it():
    bm = _manager()
    a = list(range(10))
    _run_prompt(bm, 1, a)
    bm.free(1)
    assert bm.prefix_cache.num_cached_blocks == 2 and bm.gpu_pool.num_free_blocks == 14
    bm.reset_prefix_cache()  # e.g. a worker restarted: the KV behind the hashes is gone
    assert bm.prefix_cache.num_cached_blocks == 0 and bm.gpu_pool.num_free_blocks == 16
    assert bm.num_free_gpu_blocks == 16
    assert bm.allocate(2, a) == 0  # no hit on blocks whose KV is gone
