"""The host-memory KV tier (`--kv-offload-gib`): a prefix-cache block evicted from the GPU keeps
its KV in a CPU block of the tier's own, past the swap space for preemption, and a later hit on
its hash copies it back instead of recomputing it. The copies ride the step that evicts or hits,
in its swap lists, so the worker moves them before that step's forward (while the step before
still runs, where they touch none of its blocks).

The tier is inclusive: a block copied back keeps its host copy, so evicting it again costs no
copy. Host blocks a step copies to or from are pinned until that step's copies are taken, so a
block is never overwritten before the copy that reads it ran."""

from __future__ import annotations

from collections import OrderedDict, deque

from pagedserve.scheduler_svc.kv_event_log import KVEventLog
from pagedserve.services.common.block_hash import BlockHash
from pagedserve.services.common.kv_events import MEDIUM_CPU


class HostTier:
    def __init__(self, first_block_id: int, num_blocks: int, block_size: int,
                 kv_events: KVEventLog) -> None:
        assert first_block_id >= 0 and num_blocks >= 1, (first_block_id, num_blocks)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.kv_events = kv_events
        self._free_block_ids: deque[int] = deque(range(first_block_id,
                                                       first_block_id + num_blocks))
        # hash -> host block, least recently used first
        self._block_by_hash: OrderedDict[BlockHash, int] = OrderedDict()
        self._pinned: set[int] = set()
        self._offloads: list[tuple[int, int]] = []  # (gpu, cpu)
        self._onloads: list[tuple[int, int]] = []  # (cpu, gpu)
        self.num_offloaded_blocks = 0
        self.num_onloaded_blocks = 0
        self.num_hit_tokens = 0

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_by_hash)

    def holds(self, block_hash: BlockHash) -> bool:
        return block_hash in self._block_by_hash

    def pin(self, block_hash: BlockHash) -> None:
        """Keeps a block a hit is about to copy back while that hit allocates its GPU blocks."""
        self._pinned.add(self._block_by_hash[block_hash])

    def offload(self, block_hash: BlockHash, gpu_block_id: int,
                parent_hash: BlockHash | None) -> None:
        """A GPU block leaves the prefix cache; its KV is read before this step's forward."""
        if block_hash in self._block_by_hash:
            self._block_by_hash.move_to_end(block_hash)
            return
        cpu_block_id = self._take_free_block()
        if cpu_block_id is None:
            return
        self._block_by_hash[block_hash] = cpu_block_id
        self._pinned.add(cpu_block_id)
        self._offloads.append((gpu_block_id, cpu_block_id))
        self.num_offloaded_blocks += 1
        self.kv_events.stored([block_hash], parent_hash, MEDIUM_CPU)

    def onload(self, block_hash: BlockHash, gpu_block_id: int) -> None:
        cpu_block_id = self._block_by_hash[block_hash]
        self._block_by_hash.move_to_end(block_hash)
        self._pinned.add(cpu_block_id)
        self._onloads.append((cpu_block_id, gpu_block_id))
        self.num_onloaded_blocks += 1
        self.num_hit_tokens += self.block_size

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This step's (gpu, cpu) offloads and (cpu, gpu) onloads; their blocks are unpinned."""
        offloads, onloads = self._offloads, self._onloads
        self._offloads, self._onloads = [], []
        self._pinned.clear()
        return offloads, onloads

    def forget(self, cpu_block_ids: set[int]) -> None:
        """Drops the blocks whose copies may not have run."""
        gone = [h for h, b in self._block_by_hash.items() if b in cpu_block_ids]
        for block_hash in gone:
            self._free_block_ids.append(self._block_by_hash.pop(block_hash))
        self.kv_events.removed(gone, MEDIUM_CPU)

    def clear(self) -> None:
        """The workers lost their caches: nothing held survives, no copy is pending."""
        self._free_block_ids.extend(self._block_by_hash.values())
        self._block_by_hash.clear()
        self._pinned.clear()
        self._offloads, self._onloads = [], []

    def _take_free_block(self) -> int | None:
        if self._free_block_ids:
            return self._free_block_ids.popleft()
        victim = next((h for h, b in self._block_by_hash.items() if b not in self._pinned), None)
        if victim is None:
            return None
        self.kv_events.removed([victim], MEDIUM_CPU)
        return self._block_by_hash.pop(victim)
