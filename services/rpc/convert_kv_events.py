"""KV events (services/common/kv_events.py) ↔ scheduler.proto's WatchKvEvents messages."""

from __future__ import annotations

from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.kv_events import (
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
    WatchKVEventsRequest,
)
from pagedserve.services.rpc.internal.v1 import scheduler_pb2

_MEDIUM_TO_PROTO = {MEDIUM_GPU: scheduler_pb2.KV_CACHE_MEDIUM_GPU,
                    MEDIUM_CPU: scheduler_pb2.KV_CACHE_MEDIUM_CPU}
_MEDIUM_FROM_PROTO = {v: k for k, v in _MEDIUM_TO_PROTO.items()}


def watch_kv_events_request_to_proto(request: WatchKVEventsRequest
                                     ) -> scheduler_pb2.WatchKvEventsRequest:
    return scheduler_pb2.WatchKvEventsRequest(log_id=request.log_id,
                                              last_sequence=request.last_sequence)


def watch_kv_events_request_from_proto(msg: scheduler_pb2.WatchKvEventsRequest
                                       ) -> WatchKVEventsRequest:
    return WatchKVEventsRequest(msg.log_id, msg.last_sequence)


def _event_to_proto(event: KVEvent) -> scheduler_pb2.KvEvent:
    if isinstance(event, BlockStored):
        return scheduler_pb2.KvEvent(block_stored=scheduler_pb2.BlockStored(
            block_hashes=event.block_hashes, parent_block_hash=event.parent_block_hash or b"",
            block_size=event.block_size, num_tokens=event.num_tokens,
            medium=_MEDIUM_TO_PROTO[event.medium]))
    if isinstance(event, BlockRemoved):
        return scheduler_pb2.KvEvent(block_removed=scheduler_pb2.BlockRemoved(
            block_hashes=event.block_hashes, medium=_MEDIUM_TO_PROTO[event.medium]))
    return scheduler_pb2.KvEvent(all_blocks_cleared=scheduler_pb2.AllBlocksCleared())


def _medium_from_proto(medium: int) -> str:
    try:
        return _MEDIUM_FROM_PROTO[medium]
    except KeyError:
        raise InvalidRequest(f"KV event medium {medium} is not a known KvCacheMedium",
                             field="medium") from None


def _event_from_proto(msg: scheduler_pb2.KvEvent) -> KVEvent:
    kind = msg.WhichOneof("event")
    if kind == "block_stored":
        stored = msg.block_stored
        return BlockStored(tuple(stored.block_hashes), stored.parent_block_hash or None,
                           stored.block_size, _medium_from_proto(stored.medium))
    if kind == "block_removed":
        return BlockRemoved(tuple(msg.block_removed.block_hashes),
                            _medium_from_proto(msg.block_removed.medium))
    if kind == "all_blocks_cleared":
        return AllBlocksCleared()
    raise InvalidRequest("a KvEvent has no event set", field="event")


def kv_event_batch_to_proto(batch: KVEventBatch) -> scheduler_pb2.WatchKvEventsResponse:
    return scheduler_pb2.WatchKvEventsResponse(
        log_id=batch.log_id, last_sequence=batch.last_sequence, is_snapshot=batch.is_snapshot,
        events=[_event_to_proto(e) for e in batch.events])


def kv_event_batch_from_proto(msg: scheduler_pb2.WatchKvEventsResponse) -> KVEventBatch:
    return KVEventBatch(msg.log_id, msg.last_sequence,
                        tuple(_event_from_proto(e) for e in msg.events), msg.is_snapshot)
