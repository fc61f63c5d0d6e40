"""One request over a SubmitStream call of its own, read like a server stream: what a test that
talks to the scheduler directly needs (the gateway multiplexes its requests on one call)."""

from __future__ import annotations

import grpc
from google.rpc import status_pb2
from pagedserve.services.rpc.internal.v1 import scheduler_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class RequestFailed(grpc.RpcError):
    """The request's in-band error, with the code and message its status carries."""

    def __init__(self, status: status_pb2.Status) -> None:
        super().__init__(status.message)
        self._code = _CODES.get(status.code, grpc.StatusCode.UNKNOWN)
        self._details = status.message

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class SubmitCall:
    """Its SubmitResponses, then StopIteration at `done`; its error raises RequestFailed (a
    grpc.RpcError); cancel() ends the call, which aborts the request."""

    def __init__(self, stub, msg: scheduler_pb2.SubmitRequest, timeout: float | None = None,
                 metadata=None) -> None:
        self._call = stub.SubmitStream(iter([scheduler_pb2.SubmitStreamRequest(submit=msg)]),
                                       timeout=timeout, metadata=metadata)
        self._events: list[scheduler_pb2.RequestEvent] = []
        self._error: RequestFailed | None = None

    def __iter__(self) -> SubmitCall:
        return self

    def __next__(self) -> scheduler_pb2.SubmitResponse:
        while True:
            if self._error is not None:
                raise self._error
            if not self._events:
                self._events += next(self._call).events
                continue
            event = self._events.pop(0)
            if event.error_status:
                self._error = RequestFailed(status_pb2.Status.FromString(event.error_status))
            if event.HasField("response"):
                return event.response

    def cancel(self) -> None:
        self._call.cancel()
