"""One request's spans over a SubmitStream call, which carries many requests: the gateway's
(CLIENT) and the scheduler's (SERVER), each recording what a call of the request's own would
(GenAI attributes, first token, status). The client's trace context travels inside the request
(SubmitRequest.trace_context), so every request joins its caller's trace."""

from __future__ import annotations

from typing import Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind
from pagedserve.services.rpc.tracing import (
    INSTRUMENTATION_NAME,
    CallSpan,
    RpcMethod,
    is_tracing_on,
    peer_attributes,
)

SUBMIT_STREAM = RpcMethod("pagedserve.internal.v1.SchedulerService", "SubmitStream")


class RequestSpan:
    __slots__ = ("_call",)

    def __init__(self, span: Span, msg: Any, is_server: bool) -> None:
        self._call = CallSpan(span, SUBMIT_STREAM, msg, is_server)

    @classmethod
    def client(cls, msg: Any, peer: str) -> RequestSpan | None:
        """A child of the current span, whose context goes into `msg.trace_context`; None when
        tracing is off."""
        if not is_tracing_on():
            return None
        span = _tracer().start_span(SUBMIT_STREAM.span_name, kind=SpanKind.CLIENT,
                                    attributes={**SUBMIT_STREAM.attributes(),
                                                **peer_attributes(peer)})
        propagate.inject(msg.trace_context, context=trace.set_span_in_context(span))
        return cls(span, msg, is_server=False)

    @classmethod
    def server(cls, msg: Any) -> RequestSpan | None:
        """A child of the caller's span in `msg.trace_context`; None when it has none."""
        if not msg.trace_context or not is_tracing_on():
            return None
        span = _tracer().start_span(SUBMIT_STREAM.span_name,
                                    context=propagate.extract(dict(msg.trace_context)),
                                    kind=SpanKind.SERVER, attributes=SUBMIT_STREAM.attributes())
        return cls(span, msg, is_server=True)

    @property
    def span(self) -> Span:
        return self._call.span

    def on_response(self, response: Any) -> None:
        self._call.on_response(response, is_streamed=True)

    def end(self, code: grpc.StatusCode, details: str | None = None) -> None:
        self._call.end(code, details)


def _tracer() -> trace.Tracer:
    return trace.get_tracer(INSTRUMENTATION_NAME)
