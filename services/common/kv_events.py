"""A replica's KV events, as vLLM names them: which prefix blocks it now holds (BlockStored), no
longer holds (BlockRemoved) or dropped all at once (AllBlocksCleared), per tier (`medium`). A
scheduler publishes them in order, numbered; a gateway that applies them knows what each replica
really holds. A batch is either the events after a sequence number or, when the reader is new,
was gone too long or the replica restarted (another `log_id`), a snapshot of every block held."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.services.common.block_hash import BlockHash

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIA = (MEDIUM_GPU, MEDIUM_CPU)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """A chain of full blocks, each the child of the one before; the first one's parent is
    `parent_block_hash` (None: it starts a prompt)."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    block_size: int
    medium: str = MEDIUM_GPU

    @property
    def num_tokens(self) -> int:
        return len(self.block_hashes) * self.block_size


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: tuple[BlockHash, ...]
    medium: str = MEDIUM_GPU


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KVEventBatch:
    """`last_sequence`: the number of the last event included (of the last one applied, for a
    snapshot); a reader resumes after it."""

    log_id: str
    last_sequence: int
    events: tuple[KVEvent, ...]
    is_snapshot: bool = False


@dataclass(frozen=True, slots=True)
class WatchKVEventsRequest:
    """Resume after `last_sequence` of `log_id`; an empty log_id asks for a snapshot."""

    log_id: str = ""
    last_sequence: int = 0
