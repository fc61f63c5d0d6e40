"""BlockManager: block tables, ref counts, copy-on-write, swap, admission — unit tests plus a
hypothesis state machine that simulates the worker's KV cache and checks it after every step."""

from __future__ import annotations

from collections import Counter

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from pagedserve.scheduler_svc.block_manager import AllocStatus, BlockManager
from pagedserve.scheduler_svc.prefix_cache import hash_prompt_blocks
from pagedserve.services.common.cdiv import cdiv

BS = 4


def _refs(bm: BlockManager, block_id: int, swapped: bool = False) -> int:
    return (bm.cpu_pool if swapped else bm.gpu_pool).ref_counts[block_id]


def test_allocate_covers_tokens_and_free_returns_every_block():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    assert bm.allocate(1, list(range(9))) == 0
    table = bm.block_table(1)
    assert len(table) == 3 and len(set(table)) == 3
    assert bm.num_free_gpu_blocks == 5
    assert all(_refs(bm, b) == 1 for b in table)
    bm.free(1)
    bm.free(1)  # idempotent
    bm.free(42)
    assert bm.num_free_gpu_blocks == 8 and not bm.has_seq(1)


def test_fork_shares_every_block():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    bm.allocate(1, list(range(6)))
    bm.fork(1, 2)
    assert bm.block_table(2) == bm.block_table(1)
    assert all(_refs(bm, b) == 2 for b in bm.block_table(1))
    assert bm.num_free_gpu_blocks == 6
    bm.free(1)
    assert all(_refs(bm, b) == 1 for b in bm.block_table(2))
    assert bm.num_free_gpu_blocks == 6
    bm.free(2)
    assert bm.num_free_gpu_blocks == 8


def test_append_slots_copies_a_shared_partial_last_block_once():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    bm.allocate(1, list(range(6)))  # blocks: [0..3] full, [4, 5] partial
    bm.fork(1, 2)
    first, last = bm.block_table(1)
    copies = bm.append_slots(2, 7)  # the child writes position 6 into the shared last block
    assert len(copies) == 1 and copies[0][0] == last
    new_last = copies[0][1]
    assert new_last != last
    assert bm.block_table(2) == [first, new_last]
    assert _refs(bm, first) == 2 and _refs(bm, last) == 1 and _refs(bm, new_last) == 1
    # the parent now owns its last block alone: no copy
    assert bm.append_slots(1, 7) == []
    assert bm.block_table(1) == [first, last]


def test_append_slots_on_a_block_boundary_adds_a_block_without_copy():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    bm.allocate(1, list(range(8)))
    bm.fork(1, 2)
    shared = bm.block_table(1)
    assert bm.append_slots(2, 9) == []
    assert bm.block_table(2)[:2] == shared and len(bm.block_table(2)) == 3
    assert bm.append_slots(1, 9) == []
    assert bm.block_table(1)[2] != bm.block_table(2)[2]
    assert all(_refs(bm, b) == 2 for b in shared)


def test_append_slots_within_the_table_is_a_no_op():
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    bm.allocate(1, list(range(10)))  # chunked prefill: the table already covers the prompt
    table = bm.block_table(1)
    assert bm.append_slots(1, 10) == [] and bm.block_table(1) == table
    assert bm.append_slots(1, 12) == [] and bm.block_table(1) == table
    assert bm.append_slots(1, 13) == [] and len(bm.block_table(1)) == 4
    assert bm.num_tokens(1) == 13


def test_append_slots_copies_when_the_table_already_held_the_written_token():
    # the table was sized for position 7 before the fork: the shared block holding it is copied
    bm = BlockManager(BS, 8, 4, watermark=0.0)
    bm.allocate(1, list(range(8)))
    bm.fork(1, 2)
    copies = bm.append_slots(2, 8)
    assert [src for src, _ in copies] == [bm.block_table(1)[1]]
    assert bm.block_table(2)[0] == bm.block_table(1)[0]


def test_take_block_table_counts_the_blocks_left_in_place_since_the_last_take():
    bm = BlockManager(BS, 16, 8, watermark=0.0)
    bm.allocate(1, list(range(6)))
    table, num_stable = bm.take_block_table(1)
    assert num_stable == 0 and table == bm.block_table(1)
    bm.append_slots(1, 9)  # a block appended: both earlier ones stay
    assert bm.take_block_table(1)[1] == 2
    assert bm.take_block_table(1)[1] == 3  # nothing changed since
    bm.fork(1, 2)
    bm.append_slots(1, 10)  # writes the shared third block: a copy replaces it
    assert bm.take_block_table(1)[1] == 2
    bm.append_slots(1, 20)  # slots for drafts, then trimmed below where they began
    bm.take_block_table(1)
    bm.trim(1, 4)
    assert bm.take_block_table(1) == ([bm.block_table(1)[0]], 1)
    bm.swap_out([1])
    bm.swap_in([1])
    assert bm.take_block_table(1)[1] == 0


def test_can_append_slots_counts_new_blocks_and_copies():
    bm = BlockManager(BS, 4, 4, watermark=0.0)
    bm.allocate(1, list(range(6)))
    bm.fork(1, 2)
    bm.allocate(3, list(range(4)))
    assert bm.num_free_gpu_blocks == 1
    assert bm.can_append_slots([2], [1])  # one copy
    assert not bm.can_append_slots([1, 2], [1, 1])  # worst case: both copy
    assert bm.can_append_slots([3], [4])  # one new block
    assert not bm.can_append_slots([3], [5])  # two new blocks
    assert bm.can_append_slots([1], [0])


def test_swap_out_and_in_move_shared_blocks_once_and_keep_ref_counts():
    bm = BlockManager(BS, 8, 8, watermark=0.0)
    bm.allocate(1, list(range(6)))
    bm.fork(1, 2)
    bm.append_slots(2, 7)
    shared, parent_last = bm.block_table(1)
    child_last = bm.block_table(2)[1]
    assert bm.can_swap_out([1, 2])
    out = bm.swap_out([1, 2])
    assert sorted(g for g, _ in out) == sorted([shared, parent_last, child_last])
    assert len({c for _, c in out}) == 3
    to_cpu = dict(out)
    assert bm.is_swapped(1) and bm.is_swapped(2)
    assert bm.block_table(1) == [to_cpu[shared], to_cpu[parent_last]]
    assert bm.block_table(2) == [to_cpu[shared], to_cpu[child_last]]
    assert _refs(bm, to_cpu[shared], swapped=True) == 2
    assert _refs(bm, to_cpu[parent_last], swapped=True) == 1
    assert bm.num_free_gpu_blocks == 8 and bm.num_free_cpu_blocks == 5

    assert bm.can_swap_in([1, 2])
    back = bm.swap_in([1, 2])
    assert sorted(c for c, _ in back) == sorted(to_cpu.values())
    to_gpu = dict(back)
    assert bm.block_table(1) == [to_gpu[to_cpu[shared]], to_gpu[to_cpu[parent_last]]]
    assert bm.block_table(2) == [to_gpu[to_cpu[shared]], to_gpu[to_cpu[child_last]]]
    assert _refs(bm, bm.block_table(1)[0]) == 2
    assert not bm.is_swapped(1) and bm.num_free_cpu_blocks == 8 and bm.num_free_gpu_blocks == 5
    bm.free(1)
    bm.free(2)
    assert bm.num_free_gpu_blocks == 8


def test_swap_capacity_checks():
    bm = BlockManager(BS, 8, 2, watermark=0.0)
    bm.allocate(1, list(range(12)))
    assert not bm.can_swap_out([1])  # 3 blocks, 2 cpu blocks
    bm.free(1)
    bm.allocate(1, list(range(8)))
    bm.swap_out([1])
    bm.allocate(2, list(range(28)))  # 7 of 8 gpu blocks
    assert not bm.can_swap_in([1])
    bm.free(2)
    assert bm.can_swap_in([1])


def test_can_allocate_ok_later_never_with_watermark():
    bm = BlockManager(BS, 10, 4, watermark=0.2)  # 2 blocks stay free at admission
    assert bm.can_allocate(list(range(33))) is AllocStatus.NEVER  # 9 blocks > 10 - 2
    assert bm.can_allocate(list(range(32))) is AllocStatus.OK
    bm.allocate(1, list(range(16)))  # 6 free
    assert bm.can_allocate(list(range(16))) is AllocStatus.OK  # 6 - 4 >= 2
    assert bm.can_allocate(list(range(17))) is AllocStatus.LATER  # 6 - 5 < 2
    bm.free(1)
    assert bm.can_allocate(list(range(17))) is AllocStatus.OK


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate / append / fork / free / swap / mark_computed on a small pool. The model
    stands in for the worker: it writes each computed token's KV (here: the token prefix that
    determines it) into the slot the block table names and applies every copy and swap, so a
    block shared or reused wrongly shows up as a sequence reading someone else's KV."""

    NUM_GPU = 16
    NUM_CPU = 16
    PREFIXES = ((), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6, 7, 8), (1, 2, 3, 4, 9, 9, 9, 9),
                (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12))

    @initialize(enable_prefix_caching=st.booleans())
    def setup(self, enable_prefix_caching: bool) -> None:
        self.bm = BlockManager(BS, self.NUM_GPU, self.NUM_CPU, watermark=0.1,
                               enable_prefix_caching=enable_prefix_caching)
        self.tokens: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}
        self.group_of: dict[int, int] = {}
        self.swapped: set[int] = set()
        # kv[device][block][slot]: the prefix whose KV the slot holds
        self.kv = {False: [[None] * BS for _ in range(self.NUM_GPU)],
                   True: [[None] * BS for _ in range(self.NUM_CPU)]}
        self.next_id = 0
        self.taken: dict[int, list[int]] = {}  # each table as take_block_table last gave it

    def _groups(self, swapped: bool) -> list[list[int]]:
        groups: dict[int, list[int]] = {}
        for seq_id, group in self.group_of.items():
            groups.setdefault(group, []).append(seq_id)
        return [sorted(g) for g in groups.values()
                if all((s in self.swapped) == swapped for s in g)]

    def _running(self) -> list[int]:
        return sorted(s for s in self.tokens if s not in self.swapped)

    def _copy(self, pairs: list[tuple[int, int]], src_swapped: bool, dst_swapped: bool) -> None:
        for src, dst in pairs:
            self.kv[dst_swapped][dst] = list(self.kv[src_swapped][src])

    @rule(prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(0, 3), min_size=0, max_size=10), prefill=st.booleans())
    def allocate(self, prefix: tuple[int, ...], tail: list[int], prefill: bool) -> None:
        token_ids = list(prefix) + tail
        if not token_ids:
            return
        status = self.bm.can_allocate(token_ids)
        num_blocks = cdiv(len(token_ids), BS)
        if status is AllocStatus.NEVER:
            assert num_blocks > self.NUM_GPU - self.bm.watermark_blocks
            return
        if status is AllocStatus.LATER:
            assert self.bm.num_free_gpu_blocks - num_blocks < self.bm.watermark_blocks
            return
        free_before = self.bm.num_free_gpu_blocks
        seq_id = self.next_id
        self.next_id += 1
        num_cached = self.bm.allocate(seq_id, token_ids)
        assert num_cached % BS == 0 and num_cached < len(token_ids)
        assert self.bm.num_free_gpu_blocks >= self.bm.watermark_blocks
        assert free_before - self.bm.num_free_gpu_blocks <= num_blocks
        self.tokens[seq_id] = token_ids
        self.computed[seq_id] = num_cached
        self.group_of[seq_id] = seq_id
        if prefill:
            self._compute(seq_id, len(token_ids))

    @precondition(lambda self: self._running())
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, data: st.DataObject, new_tokens: list[int]) -> None:
        seq_id = data.draw(st.sampled_from(self._running()))
        if not self.bm.can_append_slots([seq_id], [len(new_tokens)]):
            return
        old_len = len(self.tokens[seq_id])
        self.tokens[seq_id] += new_tokens
        new_len = len(self.tokens[seq_id])
        ref_counts_before = list(self.bm.gpu_pool.ref_counts)
        copies = self.bm.append_slots(seq_id, new_len)
        for src, dst in copies:
            assert ref_counts_before[src] > 1 and ref_counts_before[dst] == 0
        self._copy(copies, False, False)
        table = self.bm.block_table(seq_id)
        # the blocks the new tokens go to are this sequence's alone
        for i in range(old_len // BS, cdiv(new_len, BS)):
            assert self.bm.gpu_pool.ref_counts[table[i]] == 1

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def compute(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(self._running()))
        token_ids = self.tokens[seq_id]
        self._compute(seq_id, data.draw(st.integers(self.computed[seq_id], len(token_ids))))

    def _compute(self, seq_id: int, new_computed: int) -> None:
        token_ids = self.tokens[seq_id]
        table = self.bm.block_table(seq_id)
        for pos in range(self.computed[seq_id], new_computed):
            self.kv[False][table[pos // BS]][pos % BS] = tuple(token_ids[:pos + 1])
        self.computed[seq_id] = new_computed
        self.bm.mark_computed(seq_id, token_ids, new_computed)

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(self._running()))
        child = self.next_id
        self.next_id += 1
        self.bm.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]
        self.group_of[child] = self.group_of[parent]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self.bm.free(seq_id)
        self.bm.free(seq_id)
        for state in (self.tokens, self.computed, self.group_of):
            del state[seq_id]
        self.swapped.discard(seq_id)

    @precondition(lambda self: self._groups(swapped=False))
    @rule(data=st.data())
    def swap_out(self, data: st.DataObject) -> None:
        group = data.draw(st.sampled_from(self._groups(swapped=False)))
        if not self.bm.can_swap_out(group):
            return
        group_refs = Counter(b for s in group for b in self.bm.block_table(s))
        pairs = self.bm.swap_out(group)
        assert sorted(g for g, _ in pairs) == sorted(group_refs)
        assert len({c for _, c in pairs}) == len(pairs)
        for gpu_block, cpu_block in pairs:
            assert self.bm.cpu_pool.ref_counts[cpu_block] == group_refs[gpu_block]
        self._copy(pairs, False, True)
        self.swapped.update(group)

    @precondition(lambda self: self._groups(swapped=True))
    @rule(data=st.data())
    def swap_in(self, data: st.DataObject) -> None:
        group = data.draw(st.sampled_from(self._groups(swapped=True)))
        if not self.bm.can_swap_in(group):
            return
        group_refs = Counter(b for s in group for b in self.bm.block_table(s))
        pairs = self.bm.swap_in(group)
        assert sorted(c for c, _ in pairs) == sorted(group_refs)
        for cpu_block, gpu_block in pairs:
            assert self.bm.gpu_pool.ref_counts[gpu_block] == group_refs[cpu_block]
        self._copy(pairs, True, False)
        self.swapped.difference_update(group)

    @invariant()
    def taken_tables_hold_in_the_blocks_counted_in_place(self) -> None:
        for seq_id in self.tokens:
            table, num_stable = self.bm.take_block_table(seq_id)
            taken = self.taken.get(seq_id, [])
            assert num_stable <= len(taken) and taken[:num_stable] == table[:num_stable]
            self.taken[seq_id] = list(table)

    @invariant()
    def ref_counts_match_block_tables(self) -> None:
        refs = {False: Counter(), True: Counter()}
        for seq_id, token_ids in self.tokens.items():
            swapped = seq_id in self.swapped
            assert self.bm.is_swapped(seq_id) is swapped
            table = self.bm.block_table(seq_id)
            assert len(table) == cdiv(len(token_ids), BS)
            refs[swapped].update(table)
        for swapped, pool in ((False, self.bm.gpu_pool), (True, self.bm.cpu_pool)):
            for block_id in range(pool.num_blocks):
                assert pool.ref_counts[block_id] == refs[swapped][block_id], (swapped, block_id)
            # the count that lets a decode skip its copy-on-write scan
            assert pool.num_shared_blocks == sum(1 for r in pool.ref_counts if r > 1), swapped

    @invariant()
    def every_block_is_used_or_free_exactly_once(self) -> None:
        cache = self.bm.prefix_cache
        num_used = num_free = 0
        for block_id in range(self.NUM_GPU):
            used = self.bm.gpu_pool.ref_counts[block_id] > 0
            on_free_list = self.bm.gpu_pool.is_free(block_id)
            evictable = cache is not None and cache.is_evictable(block_id)
            assert used + on_free_list + evictable == 1, block_id
            num_used += used
            num_free += on_free_list or evictable
        assert num_free == self.bm.num_free_gpu_blocks
        assert num_used + num_free == self.NUM_GPU
        num_cpu_used = sum(1 for r in self.bm.cpu_pool.ref_counts if r)
        assert num_cpu_used + self.bm.num_free_cpu_blocks == self.NUM_CPU
        for block_id in range(self.NUM_CPU):
            assert (self.bm.cpu_pool.ref_counts[block_id] > 0) != self.bm.cpu_pool.is_free(block_id)
        if not self.tokens:
            assert self.bm.num_free_gpu_blocks == self.NUM_GPU
            assert self.bm.num_free_cpu_blocks == self.NUM_CPU

    @invariant()
    def computed_kv_is_each_sequences_own(self) -> None:
        for seq_id, token_ids in self.tokens.items():
            kv = self.kv[seq_id in self.swapped]
            table = self.bm.block_table(seq_id)
            for pos in range(self.computed[seq_id]):
                assert kv[table[pos // BS]][pos % BS] == tuple(token_ids[:pos + 1]), (seq_id, pos)

    @invariant()
    def cached_blocks_hold_the_prefix_they_are_named_by(self) -> None:
        if self.bm.prefix_cache is None:
            return
        for block_hash, block_id in self.bm.prefix_cache.cached_blocks():
            slots = self.kv[False][block_id]
            assert all(slot is not None for slot in slots), block_id
            prefix = slots[-1]
            assert all(slots[i] == prefix[:len(prefix) - BS + i + 1] for i in range(BS))
            assert hash_prompt_blocks(prefix, BS, len(prefix) // BS)[-1] == block_hash

    def teardown(self) -> None:
        for seq_id in list(self.tokens):
            self.bm.free(seq_id)
        assert self.bm.num_free_gpu_blocks == self.NUM_GPU
        assert self.bm.num_free_cpu_blocks == self.NUM_CPU
        assert all(r == 0 for r in self.bm.gpu_pool.ref_counts + self.bm.cpu_pool.ref_counts)


BlockManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50,
                                                 deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
