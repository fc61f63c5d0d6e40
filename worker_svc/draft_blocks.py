"""Which KV blocks hold the draft model's KV of their tokens, beside the target's.

The draft model computes a sequence's tokens only when the sequence proposes (a prompt that
arrives while speculation is off is left to the target), so a block can hold the target's KV of
its tokens without the draft's. A running sequence counts its own (CachedSequence.
num_draft_computed); a sequence sent whole (a swap-in, a prefix-cache hit, a recompute) learns it
from its blocks. Only full blocks are tracked: a full block's tokens never change while it is
held, and the prefix cache and swaps deal in full blocks. A block loses its mark when the target
writes its first position (new tokens in a reused block), and a copy, a swap or an import
carries the mark, or its absence, with the bytes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.worker_svc.sequence_mirrors import CachedSequence


class DraftBlocks:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._gpu: set[int] = set()  # device blocks whose draft layers hold their tokens' KV
        self._cpu: set[int] = set()

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        _move(pairs, self._gpu, self._cpu)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        _move(pairs, self._cpu, self._gpu)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        _move(pairs, self._gpu, self._gpu)

    def overwrite(self, block_ids: list[int]) -> None:
        """Blocks written from outside (a KV import): their draft layers are not known good."""
        self._gpu.difference_update(block_ids)

    def target_writes(self, scheduled: list[CachedSequence]) -> None:
        """The target computes the step's tokens: a block whose first position it writes holds
        new tokens."""
        size = self.block_size
        for seq in scheduled:
            start = seq.num_computed_tokens
            for i in range(-(-start // size), -(-(start + seq.num_scheduled_tokens) // size)):
                self._gpu.discard(seq.block_table[i])

    def mark(self, block_table: list[int], start: int, end: int) -> None:
        """The draft model computed tokens [start, end) of a sequence whose draft KV held the
        ones before start: the blocks they complete hold it."""
        self._gpu.update(block_table[start // self.block_size:end // self.block_size])

    def num_valid_tokens(self, block_table: list[int], limit: int) -> int:
        """The leading tokens (at most limit) whose draft KV the blocks hold."""
        num_blocks = 0
        for block_id in block_table:
            if block_id not in self._gpu:
                break
            num_blocks += 1
        return min(limit, num_blocks * self.block_size)


def _move(pairs: list[tuple[int, int]], src: set[int], dst: set[int]) -> None:
    marks = [(dst_id, src_id in src) for src_id, dst_id in pairs]  # all read before any write
    for block_id, is_marked in marks:
        if is_marked:
            dst.add(block_id)
        else:
            dst.discard(block_id)
