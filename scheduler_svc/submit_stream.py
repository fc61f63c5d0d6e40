"""One SubmitStream call: many requests over one gRPC stream, each step's events in one message.

Each request's outputs go straight from the engine loop into this call's pending map (no task per
request); a single writer turns whatever accumulated since its last message into the next one, so
a caller that keeps up gets one message per step and a slow one gets steps merged. A caller that
asks for a response window acknowledges what it has handled, and the writer waits while the
window is full: a gateway that falls behind the engine then reads several tokens per event
instead of a queue of one-token events, and its cost per token falls as the engine speeds up.
A request ends in-band (done, or a google.rpc.Status); the call's end aborts every request still
live in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc
from opentelemetry import trace
from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.scheduler_svc.kv_transfer import KvTransfers
from pagedserve.scheduler_svc.outputs import merge_request_outputs
from pagedserve.services.common.engine_api import SubmitRequest
from pagedserve.services.common.errors import InvalidRequest, PagedServeError, Reason
from pagedserve.services.common.outputs import FinishReason, RequestOutput
from pagedserve.services.rpc.convert_scheduler import (
    submit_request_from_proto,
    token_event_to_proto,
)
from pagedserve.services.rpc.internal.v1 import scheduler_pb2
from pagedserve.services.rpc.request_span import RequestSpan
from pagedserve.services.rpc.status import details_of, rich_status, status_of
from pagedserve.services.rpc.tracing import set_request_model

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException
MAX_MESSAGE_BYTES = 4 << 20


class _Sink:
    """One request's outputs, into its call's pending map."""

    __slots__ = ("_call", "_request_id")

    def __init__(self, call: SubmitStreamCall, request_id: str) -> None:
        self._call = call
        self._request_id = request_id

    def put_nowait(self, item: _Item) -> None:
        self._call.put(self._request_id, item, self)


class SubmitStreamCall:
    def __init__(self, engine: AsyncEngine, model: str,
                 kv_transfers: KvTransfers | None = None) -> None:
        """`model`: the served model's name, on each traced request's span; `kv_transfers`:
        what pulls the prompt blocks a request's kv_transfer names."""
        self._engine = engine
        self._kv_transfers = kv_transfers
        self._model = model
        self._pending: dict[str, list[_Item]] = {}
        self._ready = asyncio.Event()
        self._added: set[str] = set()  # the live requests the engine has
        self._adding: dict[str, asyncio.Task[None]] = {}
        # the live request of each id: what a request cancelled, or ended, still reports is
        # dropped (its id may be live again already)
        self._sinks: dict[str, _Sink] = {}
        self._cancelled: list[str] = []  # to acknowledge: nothing more comes for them
        self._spans: dict[str, RequestSpan] = {}  # of the traced live requests
        self._reader: asyncio.Task[None] | None = None
        self._window = 0  # responses the caller may leave unacknowledged; 0: no limit
        self._num_unacked = 0

    def put(self, request_id: str, item: _Item, sink: _Sink) -> None:
        if self._sinks.get(request_id) is not sink:
            return
        items = self._pending.get(request_id)
        if items is None:
            self._pending[request_id] = [item]
        else:
            items.append(item)
        self._ready.set()

    async def run(self, requests: AsyncIterator[scheduler_pb2.SubmitStreamRequest]
                  ) -> AsyncIterator[scheduler_pb2.SubmitStreamResponse]:
        """The call's responses until the caller half-closes with nothing live, or leaves."""
        self._reader = asyncio.create_task(self._read(requests))
        self._reader.add_done_callback(lambda _: self._ready.set())
        try:
            while True:
                await self._ready.wait()
                self._ready.clear()
                is_window_full = self._window and self._num_unacked >= self._window
                if (self._pending or self._cancelled) and not is_window_full:
                    pending, self._pending = self._pending, {}
                    cancelled, self._cancelled = self._cancelled, []
                    events = [scheduler_pb2.RequestEvent(request_id=request_id, done=True)
                              for request_id in cancelled]
                    events += [self._event(request_id, items)
                               for request_id, items in pending.items()]
                    for response in _messages(events):
                        self._num_unacked += 1
                        yield response
                if self._reader.done():
                    self._reader.result()  # a protocol error fails the call
                    if not self._sinks:
                        return
        finally:
            self.close()

    def close(self) -> None:
        """The caller left: abort whatever is still live."""
        if self._reader is not None:
            self._reader.cancel()
        for task in self._adding.values():
            task.cancel()
        for request_id in list(self._sinks):
            self._end(request_id, grpc.StatusCode.CANCELLED)

    async def _read(self, requests: AsyncIterator[scheduler_pb2.SubmitStreamRequest]) -> None:
        async for msg in requests:
            if msg.HasField("submit"):
                request_id = msg.submit.request_id
                if request_id in self._sinks:
                    raise InvalidRequest(f"request_id {request_id!r} is already live in this "
                                         "SubmitStream call", reason=Reason.REQUEST_ID_IN_USE,
                                         field="submit.request_id")
                sink = self._sinks[request_id] = _Sink(self, request_id)
                span = RequestSpan.server(msg.submit)
                if span is not None:
                    self._spans[request_id] = span
                self._adding[request_id] = asyncio.create_task(self._add(msg.submit, sink, span))
            elif msg.HasField("cancel_request_id"):
                self._cancel(msg.cancel_request_id)
            elif msg.HasField("finish_sequence"):
                finish = msg.finish_sequence
                if finish.request_id in self._added:
                    self._engine.finish_sequence(finish.request_id, finish.index)
            elif msg.HasField("response_window"):
                self._window = msg.response_window
                self._ready.set()
            elif msg.HasField("handled_responses"):
                self._num_unacked = max(0, self._num_unacked - msg.handled_responses)
                self._ready.set()

    async def _add(self, msg: scheduler_pb2.SubmitRequest, sink: _Sink,
                   span: RequestSpan | None) -> None:
        """A cancel while it is being added takes it out of _adding at once (the same id may
        come again right behind the cancel) and cancels this task. The request's span is
        current while it is added: its engine steps join its trace."""
        request_id = msg.request_id
        try:
            if span is None:
                await self._submit(submit_request_from_proto(msg), sink)
            else:
                with trace.use_span(span.span):
                    set_request_model(self._model)
                    await self._submit(submit_request_from_proto(msg), sink)
        except Exception as exc:
            self.put(request_id, exc, sink)
        else:
            if self._sinks.get(request_id) is sink:
                self._added.add(request_id)
            else:
                self._engine.drop(request_id, sink)  # cancelled as it was added
        finally:
            if self._adding.get(request_id) is asyncio.current_task():
                del self._adding[request_id]

    async def _submit(self, request: SubmitRequest, sink: _Sink) -> None:
        if request.kv_transfer is not None and self._kv_transfers is not None:
            await self._kv_transfers.pull(request.prompt_token_ids, request.kv_transfer)
        await self._engine.submit(request, sink)

    def _cancel(self, request_id: str) -> None:
        if request_id in self._sinks:
            self._cancelled.append(request_id)
            self._ready.set()
        task = self._adding.pop(request_id, None)
        if task is not None:
            task.cancel()
        self._end(request_id, grpc.StatusCode.CANCELLED)
        self._pending.pop(request_id, None)

    def _end(self, request_id: str, code: grpc.StatusCode, details: str | None = None) -> None:
        """Where a request's stream ends, however it ends (done, error, cancel, the call's end):
        a cancelled one is aborted in the engine, a traced one's span ends."""
        sink = self._sinks.pop(request_id, None)
        if request_id in self._added:
            self._added.discard(request_id)
            if code == grpc.StatusCode.CANCELLED:
                self._engine.drop(request_id, sink)
        span = self._spans.pop(request_id, None)
        if span is not None:
            span.end(code, details)

    def _event(self, request_id: str, items: list[_Item]) -> scheduler_pb2.RequestEvent:
        """The request's outputs since the last message, merged; its end if they end it."""
        output: RequestOutput | None = None
        error: BaseException | None = None
        for item in items:
            if isinstance(item, BaseException):
                error = item
                break
            output = item if output is None else merge_request_outputs(output, item)
            if output.finished:
                failed = [o.error for o in output.outputs if o.finish_reason == FinishReason.ERROR]
                if failed:
                    error = PagedServeError(failed[0] or "the request failed inside the engine",
                                            reason=Reason.GENERATION_FAILED)
                break
        event = scheduler_pb2.RequestEvent(request_id=request_id)
        if output is not None:
            token_event_to_proto(output, event.response)
            span = self._spans.get(request_id)
            if span is not None:
                span.on_response(event.response)
        if error is not None:
            if details_of(error).reason == Reason.INTERNAL:
                logger.error("request %s failed", request_id, exc_info=error)
            event.error_status = rich_status(error).SerializeToString()
            self._end(request_id, *status_of(error))
        elif output is not None and output.finished:
            event.done = True
            self._end(request_id, grpc.StatusCode.OK)
        return event


def _messages(events: list[scheduler_pb2.RequestEvent]
              ) -> list[scheduler_pb2.SubmitStreamResponse]:
    """One message, or several where many big events (prompt logprobs) would pass
    MAX_MESSAGE_BYTES."""
    if len(events) == 1:
        return [scheduler_pb2.SubmitStreamResponse(events=events)]
    messages, batch, num_bytes = [], [], 0
    for event in events:
        size = event.ByteSize()
        if batch and num_bytes + size > MAX_MESSAGE_BYTES:
            messages.append(scheduler_pb2.SubmitStreamResponse(events=batch))
            batch, num_bytes = [], 0
        batch.append(event)
        num_bytes += size
    messages.append(scheduler_pb2.SubmitStreamResponse(events=batch))
    return messages


async def serve_submit_stream(engine: AsyncEngine, model: str,
                              requests: AsyncIterator[scheduler_pb2.SubmitStreamRequest],
                              kv_transfers: KvTransfers | None = None
                              ) -> AsyncIterator[scheduler_pb2.SubmitStreamResponse]:
    call = SubmitStreamCall(engine, model, kv_transfers)
    async with contextlib.aclosing(call.run(requests)) as responses:
        async for response in responses:
            yield response
