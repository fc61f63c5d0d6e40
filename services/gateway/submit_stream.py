"""The gateway's SubmitStream call to one scheduler: every request it sends there shares one
gRPC stream, so a decode step of B requests costs one message, not B.

One task reads the call and hands each request's events to that request's handler, all of a
step in one pass; a request's `stream` returns at its in-band end (done) or raises its in-band
error; leaving it early (its handler says so, or raises, or its task is cancelled) cancels the
request in the scheduler (the one place where the gateway ends a request's stream).
When the call breaks (the scheduler died, restarted, or the channel failed) every live request
gets that error, and the next request opens a new call.

Each call asks for a window of RESPONSE_WINDOW responses and acknowledges every response once
its events are handed over: while the reader is behind, the scheduler merges the steps it makes
meanwhile, so each request's next event carries several tokens. The gateway's work per token
then falls as the engine outruns it, instead of a queue of one-token events building up.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable

import grpc
from google.rpc import status_pb2
from pagedserve.services.common.errors import InvalidRequest, PagedServeError, Reason, Unavailable
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.status import error_from_rpc, error_from_status, parse_status

_CODES = {code.value[0]: code for code in grpc.StatusCode}
# responses the scheduler may send ahead of the reader: one. A second one on the way kept the
# scheduler sending while the gateway was still writing the first one's events to its clients,
# so a saturated gateway got ~1.4 tokens per event instead of ~2-3 (bench.gateway_cpu, 5 ms
# steps: 57-64 -> 40-45 us of gateway CPU per token over gRPC, TTFT p50 halved)
RESPONSE_WINDOW = 1
# a request's handler of its responses: called by the call's reader, once per event, so it must
# not block; True leaves the request (it is cancelled in the scheduler)
ResponseHandler = Callable[[scheduler_pb2.SubmitResponse], bool]


class _Request:
    """One request's handler and its end: the task that submitted it sleeps until then, not
    once per event (a step's events reach every request of the call in one pass)."""

    __slots__ = ("on_response", "ended", "is_live")

    def __init__(self, on_response: ResponseHandler) -> None:
        self.on_response = on_response
        self.ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.is_live = True  # in the scheduler: left or failed by the gateway's side

    def deliver(self, event: scheduler_pb2.RequestEvent,
                error_of: Callable[[status_pb2.Status], PagedServeError]) -> None:
        ended = self.ended
        if ended.done():
            return
        try:
            if event.HasField("response") and self.on_response(event.response):
                self.is_live = not event.done
                ended.set_result(True)
                return
        except Exception as exc:
            ended.set_exception(exc)
            return
        if event.error_status:
            self.fail(error_of(status_pb2.Status.FromString(event.error_status)))
        elif event.done:
            self.is_live = False
            ended.set_result(False)

    def fail(self, error: BaseException) -> None:
        self.is_live = False
        if not self.ended.done():
            self.ended.set_exception(error)


class SubmitStreamClient:
    def __init__(self, stub: scheduler_pb2_grpc.SchedulerServiceStub, peer: str,
                 retry_after_s: float) -> None:
        self._stub = stub
        self._peer = peer
        self._retry_after_s = retry_after_s
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        # request_id -> the call it was sent on and the request; None once cancelled, until the
        # scheduler acknowledges (events of the id before that are the cancelled request's)
        self._live: dict[str, tuple[grpc.aio.StreamStreamCall, _Request | None]] = {}
        # what to write, in order: a cancel reaches the scheduler before a later submit of the
        # same id (grpc.aio allows one write in flight per call)
        # None: an acknowledgement of what the reader has handled by the time it is written
        self._outbox: deque[tuple[grpc.aio.StreamStreamCall,
                                  scheduler_pb2.SubmitStreamRequest | None]] = deque()
        self._writer: asyncio.Task[None] | None = None
        self._num_handled = 0  # responses of the open call handled and not yet acknowledged
        # the call of the write in flight, or of the last one that failed: grpc.aio fails a
        # write to a call that has just ended with INTERNAL, replacing the status it ended with
        self._writing: grpc.aio.StreamStreamCall | None = None

    async def stream(self, msg: scheduler_pb2.SubmitRequest, on_response: ResponseHandler
                     ) -> bool:
        """Submits the request and hands each of its responses to `on_response` until it ends:
        True when the handler left it, False at its in-band end; raises its in-band error (a
        PagedServeError) or what the handler raised. Leaving (the handler, an error, this
        task's cancellation) cancels the request in the scheduler."""
        request_id = msg.request_id
        if request_id in self._live:
            # the scheduler's own answer: one call cannot carry two requests of one id
            raise InvalidRequest(f"request_id {request_id!r} is already in use",
                                 reason=Reason.REQUEST_ID_IN_USE, field="request_id")
        call = self._open()
        request = _Request(on_response)
        entry = self._live[request_id] = (call, request)
        try:
            self._send(call, scheduler_pb2.SubmitStreamRequest(submit=msg))
            return await request.ended
        finally:
            if self._live.get(request_id) is entry:
                del self._live[request_id]
                if request.is_live and self._call is call:
                    self._live[request_id] = (call, None)
                    self._send(call, scheduler_pb2.SubmitStreamRequest(
                        cancel_request_id=request_id))

    def finish_sequence(self, request_id: str, index: int) -> None:
        """End output `index` of a live request in the scheduler (a stop string matched it)."""
        entry = self._live.get(request_id)
        if entry is not None and entry[1] is not None:
            self._send(entry[0], scheduler_pb2.SubmitStreamRequest(
                finish_sequence=scheduler_pb2.FinishSequence(request_id=request_id,
                                                             index=index)))

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None or self._call.done():
            self._call = self._stub.SubmitStream()
            self._num_handled = 0
            self._send(self._call, scheduler_pb2.SubmitStreamRequest(
                response_window=RESPONSE_WINDOW))
            self._reader = asyncio.create_task(self._read(self._call),
                                               name=f"submit-stream-{self._peer}")
        return self._call

    def _send(self, call: grpc.aio.StreamStreamCall,
              msg: scheduler_pb2.SubmitStreamRequest | None) -> None:
        """Without waiting (a request may be leaving from a task being cancelled); a failed
        write is the call's failure, which the reader hands every live request."""
        self._outbox.append((call, msg))
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_outbox())

    async def _write_outbox(self) -> None:
        while self._outbox:
            call, msg = self._outbox.popleft()
            if call.done():
                continue
            if msg is None:
                msg = scheduler_pb2.SubmitStreamRequest(handled_responses=self._num_handled)
                self._num_handled = 0
            self._writing = call
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await call.write(msg)
                self._writing = None

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        error: BaseException
        try:
            live, error_of = self._live, self._error
            async for response in call:
                for event in response.events:
                    entry = live.get(event.request_id)
                    if entry is None or entry[0] is not call:
                        continue
                    if entry[1] is not None:
                        entry[1].deliver(event, error_of)
                    elif event.done or event.error_status:
                        del live[event.request_id]
                self._acknowledge(call)
            error = Unavailable(f"{self._peer} ended the SubmitStream call",
                                reason=Reason.SCHEDULER_UNAVAILABLE,
                                retry_after_s=self._retry_after_s)
        except grpc.aio.AioRpcError as exc:
            if exc.code() is grpc.StatusCode.INTERNAL and self._writing is call:
                error = Unavailable(f"the SubmitStream call to {self._peer} broke under a write",
                                    reason=Reason.SCHEDULER_UNAVAILABLE,
                                    retry_after_s=self._retry_after_s)
            else:
                error = error_from_rpc(exc, self._peer)
        except asyncio.CancelledError:
            error = Unavailable(f"the gateway closed its SubmitStream call to {self._peer}",
                                reason=Reason.SCHEDULER_UNAVAILABLE,
                                retry_after_s=self._retry_after_s)
        if self._call is call:
            self._call = None
        call.cancel()
        for request_id in [r for r, (c, _) in self._live.items() if c is call]:
            request = self._live.pop(request_id)[1]
            if request is not None:
                request.fail(error)

    def _acknowledge(self, call: grpc.aio.StreamStreamCall) -> None:
        """One acknowledgement in the outbox at a time, counting every response handled
        until it is written."""
        self._num_handled += 1
        if self._num_handled == 1:
            self._send(call, None)

    def _error(self, status: status_pb2.Status) -> PagedServeError:
        code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
        return error_from_status(code, status.message, self._peer, parse_status(status))
