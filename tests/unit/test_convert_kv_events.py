"""KV events survive the wire: every event kind and tier, and a bad medium is named."""

from __future__ import annotations

import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.kv_events import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    WatchKVEventsRequest,
)
from pagedserve.services.rpc.convert_kv_events import (
    kv_event_batch_from_proto,
    kv_event_batch_to_proto,
    watch_kv_events_request_from_proto,
    watch_kv_events_request_to_proto,
)
from pagedserve.services.rpc.internal.v1 import scheduler_pb2


def test_a_batch_round_trips():
    batch = KVEventBatch("log-1", 7, (AllBlocksCleared(), BlockStored((b"a", b"b"), None, 16),
                                      BlockStored((b"c",), b"b", 16, MEDIUM_CPU),
                                      BlockRemoved((b"a",), MEDIUM_CPU)), is_snapshot=True)
    msg = kv_event_batch_to_proto(batch)
    assert msg.events[1].block_stored.num_tokens == 32
    wire = scheduler_pb2.WatchKvEventsResponse.FromString(msg.SerializeToString())
    assert kv_event_batch_from_proto(wire) == batch


def test_the_request_round_trips():
    request = WatchKVEventsRequest("log-1", 42)
    assert watch_kv_events_request_from_proto(watch_kv_events_request_to_proto(request)) == request


def test_an_unknown_medium_is_named():
    msg = scheduler_pb2.WatchKvEventsResponse(log_id="x", events=[scheduler_pb2.KvEvent(
        block_removed=scheduler_pb2.BlockRemoved(block_hashes=[b"a"], medium=9))])
    with pytest.raises(InvalidRequest, match="medium 9"):
        kv_event_batch_from_proto(msg)
