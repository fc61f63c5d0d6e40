"""The HTTP door's traces: each request opens a SERVER span that continues the caller's W3C
`traceparent` and stays current while the request runs, streamed body included, so the
gateway's scheduler calls (and under them the engine steps and the worker calls) are its
children. An OpenAI endpoint's span is named and attributed by OpenTelemetry's GenAI
conventions ("chat <model>", gen_ai.operation.name, gen_ai.provider.name,
gen_ai.request.model); the handlers add what the request asked and used (record_request,
record_delta, record_usage)."""

from __future__ import annotations

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from pagedserve.services.common.outputs import Usage
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.tracing import (
    FINISH_REASONS,
    INSTRUMENTATION_NAME,
    MAX_TOKENS,
    NUM_CACHED_TOKENS,
    NUM_OUTPUT_TOKENS,
    NUM_PROMPT_TOKENS,
    OPERATION_NAME,
    PROVIDER,
    PROVIDER_NAME,
    REQUEST_ID,
    REQUEST_MODEL,
    STRUCTURED_OUTPUT,
    TEMPERATURE,
    TOP_P,
    N,
)
from starlette.types import ASGIApp, Message, Receive, Scope, Send

OPERATIONS = {"/v1/chat/completions": "chat", "/v1/completions": "text_completion",
              "/v1/embeddings": "embeddings"}
UNTRACED_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapes would drown requests


class HttpTracing:
    def __init__(self, app: ASGIApp, model: str) -> None:
        """`model`: the served model's name (a request naming another is refused)."""
        self.app = app
        self._model = model
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNTRACED_PATHS:
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        attributes = {"http.request.method": method, "url.path": path}
        operation = OPERATIONS.get(path)
        if operation is not None:
            attributes |= {OPERATION_NAME: operation, PROVIDER_NAME: PROVIDER,
                           REQUEST_MODEL: self._model}
        headers = {key.decode("latin-1"): value.decode("latin-1")
                   for key, value in scope["headers"]}
        span = self._tracer.start_span(
            f"{operation} {self._model}" if operation else f"{method} {path}",
            context=propagate.extract(headers), kind=SpanKind.SERVER, attributes=attributes)
        status = 500  # unless a response starts

        async def traced_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        with trace.use_span(span, end_on_exit=False, record_exception=False,
                            set_status_on_exception=False):
            try:
                await self.app(scope, receive, traced_send)
            except BaseException as exc:
                span.record_exception(exc)
                raise
            finally:
                span.set_attribute("http.response.status_code", status)
                if status >= 500:  # the server's fault; a 4xx is the client's
                    span.set_attribute("error.type", str(status))
                    span.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
                span.end()


def record_request(response_id: str, sampling: SamplingParams | None = None) -> None:
    """`sampling`: a generation's (an embedding has none)."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    span.set_attribute(REQUEST_ID, response_id)
    if sampling is not None:
        span.set_attributes({N: sampling.n, MAX_TOKENS: sampling.max_tokens,
                             TEMPERATURE: sampling.temperature, TOP_P: sampling.top_p})
        if sampling.structured_outputs is not None:
            span.set_attribute(STRUCTURED_OUTPUT, sampling.structured_outputs.kind)


def record_usage(usage: Usage) -> None:
    """Added to what the span holds: a request of several prompts uses them all."""
    span = trace.get_current_span()
    if not span.is_recording():
        return
    held = getattr(span, "attributes", None) or {}
    span.set_attributes({
        name: held.get(name, 0) + value for name, value in (
            (NUM_PROMPT_TOKENS, usage.prompt_tokens), (NUM_OUTPUT_TOKENS, usage.completion_tokens),
            (NUM_CACHED_TOKENS, usage.cached_tokens))})


def record_finish_reason(reason: str) -> None:
    span = trace.get_current_span()
    if span.is_recording():
        held = getattr(span, "attributes", None) or {}
        span.set_attribute(FINISH_REASONS, [*held.get(FINISH_REASONS, ()), reason])
