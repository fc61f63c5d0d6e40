"""What each scheduler replica really holds in its prefix cache, per tier, as its KV events tell
(services/common/kv_events.py): the affinity router's first choice, before its own guesses.

A replica's blocks count only while its event stream is live: when the stream breaks (the replica
failed, restarted, or was cut off) the replica is forgotten at once for routing, but what it held
is kept, with the log and the sequence of the last event applied, so that a reconnect resumes
after it. A restarted replica answers with another log, whose snapshot replaces all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.services.common.block_hash import BlockHash
from pagedserve.services.common.kv_events import (
    MEDIA,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockStored,
    KVEventBatch,
    WatchKVEventsRequest,
)


@dataclass(slots=True)
class _ReplicaBlocks:
    log_id: str = ""
    last_sequence: int = 0
    is_live: bool = False  # its stream delivered this log and still runs
    held: dict[str, set[BlockHash]] = field(default_factory=lambda: {m: set() for m in MEDIA})


class KVIndex:
    """Not thread-safe (the gateway's event loop only)."""

    def __init__(self, offload_weight: float) -> None:
        self.offload_weight = offload_weight
        self._replicas: dict[str, _ReplicaBlocks] = {}

    def resume_point(self, address: str) -> WatchKVEventsRequest:
        replica = self._replicas.get(address)
        if replica is None:
            return WatchKVEventsRequest()
        return WatchKVEventsRequest(replica.log_id, replica.last_sequence)

    def apply(self, address: str, batch: KVEventBatch) -> None:
        replica = self._replicas.setdefault(address, _ReplicaBlocks())
        if batch.log_id != replica.log_id and not batch.is_snapshot:
            raise ValueError(f"KV events of log {batch.log_id!r} from {address} follow log "
                             f"{replica.log_id!r} without a snapshot")
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                for held in replica.held.values():
                    held.clear()
            elif isinstance(event, BlockStored):
                replica.held[event.medium].update(event.block_hashes)
            else:
                replica.held[event.medium].difference_update(event.block_hashes)
        replica.log_id = batch.log_id
        replica.last_sequence = batch.last_sequence
        replica.is_live = True

    def mark_lost(self, address: str) -> None:
        """Its stream broke: not counted until it resumes."""
        replica = self._replicas.get(address)
        if replica is not None:
            replica.is_live = False

    def remove(self, address: str) -> None:
        self._replicas.pop(address, None)

    def is_live(self, address: str) -> bool:
        replica = self._replicas.get(address)
        return replica is not None and replica.is_live

    def num_held_blocks(self, address: str, medium: str = MEDIUM_GPU) -> int:
        replica = self._replicas.get(address)
        return len(replica.held[medium]) if replica is not None and replica.is_live else 0

    def weight(self, address: str, block_hash: BlockHash) -> float:
        """What the replica holding the block is worth: 1 on the GPU, offload_weight in a slower
        tier, 0 when it does not hold it or is not live."""
        replica = self._replicas.get(address)
        if replica is None or not replica.is_live:
            return 0.0
        if block_hash in replica.held[MEDIUM_GPU]:
            return 1.0
        if any(block_hash in held for medium, held in replica.held.items() if medium != MEDIUM_GPU):
            return self.offload_weight
        return 0.0
