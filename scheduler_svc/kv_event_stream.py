"""WatchKvEvents on the scheduler's side: the KV event log read after each engine step."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from pagedserve.scheduler_svc.kv_event_log import KVEventLog
from pagedserve.services.common.kv_events import KVEventBatch, WatchKVEventsRequest


async def watch_kv_events(log: KVEventLog, request: WatchKVEventsRequest,
                          wait_for_step: Callable[[], Awaitable[None]]
                          ) -> AsyncIterator[KVEventBatch]:
    """From where `request` resumes (or a snapshot), then whatever each step adds; ends only
    when the caller stops reading."""
    log_id, last_sequence = request.log_id, request.last_sequence
    while True:
        for batch in log.read(log_id, last_sequence):
            if batch.events or batch.is_snapshot:
                yield batch
            log_id, last_sequence = batch.log_id, batch.last_sequence
        if last_sequence == log.last_sequence:
            await wait_for_step()
