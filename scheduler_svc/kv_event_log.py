"""The scheduler's KV events (services/common/kv_events.py), numbered and kept in a bounded log
with a mirror of every block held, so a reader resumes after the last event it applied or, when
that event has left the log (or the reader knows another log: a restart), starts again from a
snapshot. Written by the engine thread, read by the event loop: every method takes the lock."""

from __future__ import annotations

import threading
import uuid
from collections import deque
from collections.abc import Sequence

from pagedserve.services.common.block_hash import BlockHash
from pagedserve.services.common.kv_events import (
    MEDIA,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)

MAX_EVENTS = 16384  # a reader further behind than this gets a snapshot
MAX_SNAPSHOT_BLOCKS = 4096  # blocks per snapshot batch: a batch stays far below 4 MB


class KVEventLog:
    def __init__(self, block_size: int, max_events: int = MAX_EVENTS) -> None:
        assert block_size >= 1 and max_events >= 1, (block_size, max_events)
        self.block_size = block_size
        self.log_id = uuid.uuid4().hex  # a restarted replica's log is another log
        self._lock = threading.Lock()
        self._events: deque[KVEvent] = deque(maxlen=max_events)
        self._last_sequence = 0
        # per medium, hash -> parent hash, in the order stored: what a snapshot lists
        self._held: dict[str, dict[BlockHash, BlockHash | None]] = {m: {} for m in MEDIA}

    @property
    def last_sequence(self) -> int:
        return self._last_sequence

    def num_held_blocks(self, medium: str = MEDIUM_GPU) -> int:
        return len(self._held[medium])

    def parent(self, block_hash: BlockHash, medium: str = MEDIUM_GPU) -> BlockHash | None:
        with self._lock:
            return self._held[medium].get(block_hash)

    def stored(self, block_hashes: Sequence[BlockHash], parent_block_hash: BlockHash | None,
               medium: str = MEDIUM_GPU) -> None:
        """`block_hashes`: a chain, each the child of the one before."""
        if not block_hashes:
            return
        held = self._held[medium]
        with self._lock:
            parent = parent_block_hash
            for block_hash in block_hashes:
                held[block_hash] = parent
                parent = block_hash
            self._append(BlockStored(tuple(block_hashes), parent_block_hash, self.block_size,
                                     medium))

    def removed(self, block_hashes: Sequence[BlockHash], medium: str = MEDIUM_GPU) -> None:
        if not block_hashes:
            return
        held = self._held[medium]
        with self._lock:
            for block_hash in block_hashes:
                held.pop(block_hash, None)
            self._append(BlockRemoved(tuple(block_hashes), medium))

    def cleared(self) -> None:
        with self._lock:
            for held in self._held.values():
                held.clear()
            self._append(AllBlocksCleared())

    def read(self, log_id: str, last_sequence: int) -> list[KVEventBatch]:
        """The events after `last_sequence` of log `log_id` (none: an empty batch), or a snapshot
        split into batches, the first one marked, when they are not all in this log."""
        with self._lock:
            num_kept = len(self._events)
            first_kept = self._last_sequence - num_kept + 1
            if log_id == self.log_id and first_kept - 1 <= last_sequence <= self._last_sequence:
                num_new = self._last_sequence - last_sequence
                events = tuple(self._events[i] for i in range(num_kept - num_new, num_kept))
                return [KVEventBatch(self.log_id, self._last_sequence, events)]
            return self._snapshot()

    def _snapshot(self) -> list[KVEventBatch]:
        chains: list[BlockStored] = []
        for medium, held in self._held.items():
            hashes: list[BlockHash] = []
            first_parent: BlockHash | None = None
            for block_hash, parent in held.items():
                if hashes and (parent != hashes[-1] or len(hashes) == MAX_SNAPSHOT_BLOCKS):
                    chains.append(BlockStored(tuple(hashes), first_parent, self.block_size,
                                              medium))
                    hashes = []
                if not hashes:
                    first_parent = parent
                hashes.append(block_hash)
            if hashes:
                chains.append(BlockStored(tuple(hashes), first_parent, self.block_size, medium))
        batches: list[KVEventBatch] = []
        events: list[KVEvent] = [AllBlocksCleared()]
        num_blocks = 0
        for chain in chains:
            if num_blocks + len(chain.block_hashes) > MAX_SNAPSHOT_BLOCKS and events:
                batches.append(KVEventBatch(self.log_id, self._last_sequence, tuple(events),
                                            is_snapshot=not batches))
                events, num_blocks = [], 0
            events.append(chain)
            num_blocks += len(chain.block_hashes)
        batches.append(KVEventBatch(self.log_id, self._last_sequence, tuple(events),
                                    is_snapshot=not batches))
        return batches

    def _append(self, event: KVEvent) -> None:
        self._events.append(event)
        self._last_sequence += 1
