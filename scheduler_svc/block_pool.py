"""One device's KV-cache blocks. A block is free (ref 0), referenced (ref > 0), or parked by an
owner such as the prefix cache's evictor (ref 0, off the free list); that owner gives it back
with `incref` or `free`."""

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
        self.num_shared_blocks = 0  # ref > 1: only these are copied on write

    @property
    def num_free_blocks(self) -> int:
        """Parked blocks not included."""
        return len(self._free_block_ids)

    def is_free(self, block_id: int) -> bool:
        return self._is_free[block_id]

    def allocate(self) -> int:
        assert self._free_block_ids, f"no free {self.device.value} block"
        block_id = self._free_block_ids.popleft()
        self._is_free[block_id] = False
        assert self.ref_counts[block_id] == 0, (block_id, self.ref_counts[block_id])
        self.ref_counts[block_id] = 1
        return block_id

    def incref(self, block_id: int, num_refs: int = 1) -> None:
        assert not self._is_free[block_id], f"{self.device.value} block {block_id} is free"
        ref_count = self.ref_counts[block_id]
        self.ref_counts[block_id] = ref_count + num_refs
        self.num_shared_blocks += ref_count <= 1 < ref_count + num_refs

    def decref(self, block_id: int, num_refs: int = 1) -> int:
        """At 0 the caller decides where the block goes."""
        ref_count = self.ref_counts[block_id]
        assert ref_count >= num_refs, (block_id, ref_count)
        self.ref_counts[block_id] = ref_count - num_refs
        self.num_shared_blocks -= ref_count - num_refs <= 1 < ref_count
        return ref_count - num_refs

    def free(self, block_id: int) -> None:
        assert self.ref_counts[block_id] == 0, (block_id, self.ref_counts[block_id])
        assert not self._is_free[block_id], f"{self.device.value} block {block_id} freed twice"
        self._is_free[block_id] = True
        self._free_block_ids.append(block_id)
