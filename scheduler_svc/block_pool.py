"""One device's physical KV-cache blocks: a free list and a reference count per block.

A block is in exactly one of three states: on the free list (ref 0), referenced by block tables
(ref > 0), or held outside both by an owner such as the prefix cache's evictor (ref 0, not on
the free list). The pool only keeps the first two honest; whoever parks blocks outside the free
list gives them back with `incref` (reuse) or `release` (to the free list).
"""

from __future__ import annotations

import enum
from collections import deque


class Device(enum.Enum):
    GPU = "gpu"
    CPU = "cpu"


class BlockPool:
    def __init__(self, device: Device, num_blocks: int) -> None:
        assert num_blocks >= 0, num_blocks
        self.device = device
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # FIFO: block ids come out in a predictable order and freed blocks rest longest
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks on the free list (not counting blocks parked elsewhere, e.g. the evictor)."""
        return len(self._free_block_ids)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    def allocate(self) -> int:
        """Take a block from the free list; it comes back with ref 1."""
        assert self._free_block_ids, f"no free {self.device.value} block"
        block_id = self._free_block_ids.popleft()
        self._is_free[block_id] = False
        assert self.ref_counts[block_id] == 0, (block_id, self.ref_counts[block_id])
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int, num_refs: int = 1) -> None:
        """Add references to a block that is in use, or take back a block parked off the free list."""
        assert not self._is_free[block_id], f"{self.device.value} block {block_id} is free"
        self.ref_counts[block_id] += num_refs

    def decref(self, block_id: int, num_refs: int = 1) -> int:
        """Drop references; returns what is left. At 0 the caller decides where the block goes."""
        assert self.ref_counts[block_id] >= num_refs, (block_id, self.ref_counts[block_id])
        self.ref_counts[block_id] -= num_refs
        return self.ref_counts[block_id]

    def release(self, block_id: int) -> None:
        """Put an unreferenced block back on the free list."""
        assert self.ref_counts[block_id] == 0, (block_id, self.ref_counts[block_id])
        assert not self._is_free[block_id], f"{self.device.value} block {block_id} freed twice"
        self._is_free[block_id] = True
        self._free_block_ids.append(block_id)
