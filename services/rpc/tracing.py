"""OpenTelemetry tracing: one trace per request across gateway → scheduler → worker. While it is
off, servers and channels get no interceptors. Health and reflection calls are not traced: probes
would drown the requests. opentelemetry-instrumentation-grpc records deprecated attribute names,
makes a client's INVALID_ARGUMENT a server error, and cannot read the messages.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from pagedserve.services.rpc.convert_common import finish_reason_from_proto

logger = logging.getLogger(__name__)

INSTRUMENTATION_NAME = "pagedserve"
UNTRACED_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                               "grpc.reflection.v1.ServerReflection"})

OPERATION_NAME = "gen_ai.operation.name"  # "chat" (messages), "text_completion", "embeddings"
PROVIDER_NAME = "gen_ai.provider.name"
PROVIDER = "pagedserve"
REQUEST_MODEL = "gen_ai.request.model"
REQUEST_ID = "gen_ai.response.id"  # the request_id, which every response echoes
N = "gen_ai.request.choice.count"
MAX_TOKENS = "gen_ai.request.max_tokens"
TEMPERATURE = "gen_ai.request.temperature"
TOP_P = "gen_ai.request.top_p"
NUM_PROMPT_TOKENS = "gen_ai.usage.input_tokens"
NUM_CACHED_TOKENS = "gen_ai.usage.cache_read.input_tokens"
NUM_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
FINISH_REASONS = "gen_ai.response.finish_reasons"
TIME_TO_FIRST_TOKEN = "gen_ai.response.time_to_first_chunk"  # seconds; also the event below
FIRST_TOKEN_EVENT = "gen_ai.first_token"
STEP_ID = "pagedserve.step_id"
NUM_SEQS = "pagedserve.num_seqs"
NUM_SCHEDULED_TOKENS = "pagedserve.num_scheduled_tokens"
STRUCTURED_OUTPUT = "pagedserve.structured_output"  # the constraint's kind: json_schema, regex, ...
STEP_TIMINGS = ("cache_ops_ns", "prepare_ns", "forward_ns", "sample_ns",
                "mask_ns")  # pagedserve.<name>
# The gateway's routing of a request: the replica of its last attempt, why, and its failovers.
ROUTING_REPLICA = "pagedserve.routing.replica"
ROUTING_REASON = "pagedserve.routing.reason"
NUM_FAILOVERS = "pagedserve.routing.num_failovers"
FAILOVER_EVENT = "pagedserve.failover"

# the codes that make a SERVER span an error: the server's fault
_SERVER_ERROR_CODES = frozenset({
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
_CODE_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def is_tracing_on() -> bool:
    return isinstance(trace.get_tracer_provider(), TracerProvider)


def set_request_model(model: str) -> None:
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(REQUEST_MODEL, model)


def set_routing_decision(replica: str, reason: str, num_failovers: int) -> None:
    """The replica a request was sent to on the current span (the gateway's SERVER span); a
    failover also leaves an event naming the replica it moved to."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attributes({ROUTING_REPLICA: replica, ROUTING_REASON: reason,
                             NUM_FAILOVERS: num_failovers})
        if num_failovers:
            span.add_event(FAILOVER_EVENT, {ROUTING_REPLICA: replica})


def server_interceptors() -> list[grpc.aio.ServerInterceptor]:
    return [ServerTracingInterceptor()] if is_tracing_on() else []


def inject_metadata(metadata: Iterable[tuple[str, Any]] | None,
                    context: Context | None = None) -> list[tuple[str, Any]]:
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return [*(metadata or ()), *carrier.items()]


def extract_context(metadata: Iterable[tuple[str, Any]] | None) -> Context:
    return propagate.extract({key: value for key, value in metadata or ()
                              if isinstance(value, str)})


@dataclass(frozen=True, slots=True)
class RpcMethod:
    service: str
    method: str

    @classmethod
    def parse(cls, full_method: str | bytes) -> RpcMethod:
        if isinstance(full_method, bytes):
            full_method = full_method.decode()
        service, _, method = full_method.lstrip("/").rpartition("/")
        return cls(service, method)

    @property
    def span_name(self) -> str:
        return f"{self.service}/{self.method}"

    def attributes(self) -> dict[str, str]:
        return {"rpc.system.name": "grpc", "rpc.method": self.span_name}


class CallSpan:
    """Nothing is computed when the span does not record."""

    __slots__ = ("span", "_is_server", "_attributes", "_fold_response", "_num_responses")

    def __init__(self, span: Span, rpc: RpcMethod, request: Any, is_server: bool) -> None:
        self.span = span
        self._is_server = is_server
        self._attributes: dict[str, Any] = {}
        self._fold_response = None
        self._num_responses = 0
        recorded = _RPC_ATTRIBUTES.get(rpc.span_name) if span.is_recording() else None
        if recorded is not None:
            if recorded.request is not None:
                self._attributes.update(recorded.request(request))
            self._fold_response = recorded.response

    def on_response(self, response: Any, is_streamed: bool) -> None:
        if is_streamed and self._num_responses == 0 and self.span.is_recording():
            now = time.time_ns()  # time to first token, seen from here
            self.span.add_event(FIRST_TOKEN_EVENT, timestamp=now)
            start = getattr(self.span, "start_time", None)
            if start is not None:
                self._attributes[TIME_TO_FIRST_TOKEN] = (now - start) / 1e9
        self._num_responses += 1
        if self._fold_response is not None:
            self._fold_response(response, self._attributes)

    def end(self, code: grpc.StatusCode, details: str | None = None,
            error: BaseException | None = None, end_time: int | None = None) -> None:
        span = self.span
        if span.is_recording():
            span.set_attributes(self._attributes)
            span.set_attribute("rpc.response.status_code", code.name)
            # A client that cancels its own call (a stop string matched) did nothing wrong.
            is_error = (code in _SERVER_ERROR_CODES if self._is_server
                        else code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED))
            if is_error:
                span.set_attribute("error.type", code.name)
                span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}"))
            if error is not None:
                span.record_exception(error)
        span.end(end_time=end_time)


def _status_code(code: Any) -> grpc.StatusCode:
    if code is None:
        return grpc.StatusCode.OK
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODE_BY_NUMBER.get(int(code), grpc.StatusCode.UNKNOWN)


class ServerTracingInterceptor(grpc.aio.ServerInterceptor):
    """The span is current while the handler runs, so its calls and spans become children."""

    def __init__(self, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        rpc = RpcMethod.parse(handler_call_details.method)
        if handler is None or rpc.service in UNTRACED_SERVICES:
            return handler
        # pagedserve's methods all take one request; client-streaming ones pass untraced
        kw = {"request_deserializer": handler.request_deserializer,
              "response_serializer": handler.response_serializer}
        metadata = handler_call_details.invocation_metadata
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap(handler.unary_unary, rpc, metadata), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap(handler.unary_stream, rpc, metadata, is_stream=True), **kw)
        return handler

    def _start(self, rpc: RpcMethod, metadata: Any, request: Any) -> CallSpan:
        span = self._tracer.start_span(rpc.span_name, context=extract_context(metadata),
                                       kind=SpanKind.SERVER, attributes=rpc.attributes())
        return CallSpan(span, rpc, request, is_server=True)

    def _wrap(self, behavior: Callable[..., Any], rpc: RpcMethod, metadata: Any,
              is_stream: bool = False) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def streaming(request: Any, context: grpc.aio.ServicerContext) -> Any:
                call = self._start(rpc, metadata, request)
                span_context = trace.set_span_in_context(call.span)
                # Current only while the handler runs: between responses gRPC writes, and a
                # stream abandoned there is closed from another task (another context).
                async with contextlib.aclosing(behavior(request, context)) as responses:
                    while True:
                        token = otel_context.attach(span_context)
                        try:
                            response = await anext(responses)
                        except StopAsyncIteration:
                            break
                        except BaseException as exc:
                            _end_server_call(call, context, exc)
                            raise
                        finally:
                            otel_context.detach(token)
                        call.on_response(response, is_streamed=True)
                        try:
                            yield response
                        except BaseException as exc:
                            _end_server_call(call, context, exc)
                            raise
                _end_server_call(call, context, None)

            return streaming
        if not inspect.iscoroutinefunction(behavior):
            return behavior  # a synchronous handler: none of ours

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            """A unary call, or a stream its handler writes (context.write) instead of yielding:
            then its writes are the responses recorded."""
            call = self._start(rpc, metadata, request)
            with trace.use_span(call.span, record_exception=False, set_status_on_exception=False):
                try:
                    response = await behavior(
                        request, _RecordedWrites(context, call) if is_stream else context)
                except BaseException as exc:
                    _end_server_call(call, context, exc)
                    raise
                if response is not None:
                    call.on_response(response, is_streamed=False)
                _end_server_call(call, context, None)
                return response

        return unary


class _RecordedWrites:
    """A servicer context whose streamed writes fold into the call's span, as yielded
    responses do."""

    __slots__ = ("_context", "_call")

    def __init__(self, context: grpc.aio.ServicerContext, call: CallSpan) -> None:
        self._context = context
        self._call = call

    async def write(self, message: Any) -> None:
        self._call.on_response(message, is_streamed=True)
        await self._context.write(message)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


def _end_server_call(call: CallSpan, context: grpc.aio.ServicerContext,
                     exc: BaseException | None) -> None:
    """The status the client will see; an unexpected exception is UNKNOWN, as gRPC answers."""
    if exc is None or isinstance(exc, grpc.aio.AbortError):
        call.end(_status_code(context.code()), context.details())
    elif isinstance(exc, asyncio.CancelledError | GeneratorExit):
        call.end(grpc.StatusCode.CANCELLED)
    else:
        call.end(_status_code(context.code() or grpc.StatusCode.UNKNOWN), str(exc), error=exc)


class _ClientSpans:
    def __init__(self, target: str, tracer_provider: trace.TracerProvider | None) -> None:
        self._tracer = trace.get_tracer(INSTRUMENTATION_NAME, tracer_provider=tracer_provider)
        self._peer = peer_attributes(target)

    def start(self, details: Any, request: Any) -> tuple[CallSpan | None, list[Any]]:
        """(None, []) if untraced."""
        rpc = RpcMethod.parse(details.method)
        if rpc.service in UNTRACED_SERVICES:
            return None, []
        span = self._tracer.start_span(rpc.span_name, kind=SpanKind.CLIENT,
                                       attributes={**rpc.attributes(), **self._peer})
        metadata = inject_metadata(details.metadata, trace.set_span_in_context(span))
        return CallSpan(span, rpc, request, is_server=False), metadata


def peer_attributes(target: str) -> dict[str, Any]:
    host, _, port = target.rpartition(":")
    return ({"server.address": host, "server.port": int(port)} if port.isdigit()
            else {"server.address": target})


class _AioClientInterceptor:
    def __init__(self, spans: _ClientSpans) -> None:
        self._spans = spans
        self._endings: set[asyncio.Task] = set()  # strong references until they ran

    async def _intercept(self, continuation: Callable[..., Any], details: Any,
                         request: Any) -> Any:
        call_span, metadata = self._spans.start(details, request)
        if call_span is None:
            return await continuation(details, request)
        try:
            call = await continuation(details._replace(metadata=grpc.aio.Metadata(*metadata)),
                                      request)
        except BaseException as exc:
            call_span.end(grpc.StatusCode.CANCELLED if isinstance(exc, asyncio.CancelledError)
                          else grpc.StatusCode.UNKNOWN, str(exc))
            raise
        # the span ends however the call does, a stream the caller left early included
        call.add_done_callback(lambda done: self._on_done(call_span, done))
        return call

    def _on_done(self, call_span: CallSpan, call: grpc.aio.Call) -> None:
        end_time = time.time_ns()

        async def end() -> None:  # an aio call's status is only readable by awaiting it
            call_span.end(await call.code(), await call.details(), end_time=end_time)

        task = asyncio.get_running_loop().create_task(end())
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)


class _AioUnaryUnaryInterceptor(_AioClientInterceptor, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


class _AioUnaryStreamInterceptor(_AioClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await self._intercept(continuation, client_call_details, request)


def aio_client_interceptors(target: str, tracer_provider: trace.TracerProvider | None = None
                            ) -> list[grpc.aio.ClientInterceptor]:
    """Unary and server-streaming calls, the only kinds pagedserve's clients make."""
    if tracer_provider is None and not is_tracing_on():
        return []
    spans = _ClientSpans(target, tracer_provider)
    return [_AioUnaryUnaryInterceptor(spans), _AioUnaryStreamInterceptor(spans)]


class ClientTracingInterceptor(grpc.UnaryUnaryClientInterceptor):
    """For the scheduler's synchronous worker channels, called where the step span is current."""

    def __init__(self, target: str, tracer_provider: trace.TracerProvider | None = None) -> None:
        self._spans = _ClientSpans(target, tracer_provider)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        call_span, metadata = self._spans.start(client_call_details, request)
        if call_span is None:
            return continuation(client_call_details, request)
        outcome = continuation(client_call_details._replace(metadata=metadata), request)
        outcome.add_done_callback(lambda done: call_span.end(done.code(), done.details()))
        return outcome


def client_interceptors(target: str) -> list[ClientTracingInterceptor]:
    return [ClientTracingInterceptor(target)] if is_tracing_on() else []


@dataclass(frozen=True, slots=True)
class _Recorded:
    request: Callable[[Any], dict[str, Any]] | None = None
    response: Callable[[Any, dict[str, Any]], None] | None = None  # folds one into the dict


def _add_finish_reason(msg: Any, attributes: dict[str, Any]) -> None:
    if msg.finish_reason:
        reason = finish_reason_from_proto(msg.finish_reason).value
        attributes[FINISH_REASONS] = [*attributes.get(FINISH_REASONS, ()), reason]


def _generate_request(msg: Any) -> dict[str, Any]:
    """Unset sampling fields are not recorded."""
    attributes: dict[str, Any] = {
        OPERATION_NAME: "chat" if msg.HasField("messages") else "text_completion",
        PROVIDER_NAME: PROVIDER}
    if msg.request_id:
        attributes[REQUEST_ID] = msg.request_id
    for name, field in ((N, "n"), (MAX_TOKENS, "max_tokens"), (TEMPERATURE, "temperature"),
                        (TOP_P, "top_p")):
        if msg.sampling.HasField(field):
            attributes[name] = getattr(msg.sampling, field)
    if msg.sampling.HasField("structured_outputs"):
        kind = msg.sampling.structured_outputs.WhichOneof("constraint")
        if kind is not None:
            attributes[STRUCTURED_OUTPUT] = kind
    return attributes


def _usage(msg: Any, attributes: dict[str, Any]) -> None:
    attributes[REQUEST_ID] = msg.request_id  # the server's own when the client sent none
    if msg.HasField("usage"):
        attributes[NUM_PROMPT_TOKENS] = msg.usage.prompt_tokens
        attributes[NUM_OUTPUT_TOKENS] = msg.usage.completion_tokens
        attributes[NUM_CACHED_TOKENS] = msg.usage.cached_tokens


def _generate_stream_response(msg: Any, attributes: dict[str, Any]) -> None:
    _usage(msg, attributes)
    _add_finish_reason(msg, attributes)


def _generate_response(msg: Any, attributes: dict[str, Any]) -> None:
    _usage(msg, attributes)
    for output in msg.outputs:
        _add_finish_reason(output, attributes)


def _submit_request(msg: Any) -> dict[str, Any]:
    return {OPERATION_NAME: "embeddings" if msg.is_pooling else "text_completion",
            PROVIDER_NAME: PROVIDER, REQUEST_ID: msg.request_id,
            NUM_PROMPT_TOKENS: len(msg.prompt_token_ids), N: msg.sampling.n,
            MAX_TOKENS: msg.sampling.max_tokens, TEMPERATURE: msg.sampling.temperature,
            TOP_P: msg.sampling.top_p}


def _token_event(msg: Any, attributes: dict[str, Any]) -> None:
    attributes[NUM_CACHED_TOKENS] = msg.num_cached_tokens
    num_tokens = sum(len(delta.token_ids) for delta in msg.outputs)
    attributes[NUM_OUTPUT_TOKENS] = attributes.get(NUM_OUTPUT_TOKENS, 0) + num_tokens
    for delta in msg.outputs:
        _add_finish_reason(delta, attributes)


def _step_request(msg: Any) -> dict[str, Any]:
    seqs = [*msg.new_seqs, *msg.running_seqs]
    num_decodes = len(msg.decode_seq_ids)  # one token each
    return {STEP_ID: msg.step_id, NUM_SEQS: len(seqs) + num_decodes,
            NUM_SCHEDULED_TOKENS: sum(s.num_scheduled_tokens for s in seqs) + num_decodes}


def _step_result(msg: Any, attributes: dict[str, Any]) -> None:
    for name in STEP_TIMINGS:
        attributes[f"pagedserve.{name}"] = getattr(msg.timings, name)


def _embed_request(msg: Any) -> dict[str, Any]:
    attributes: dict[str, Any] = {OPERATION_NAME: "embeddings", PROVIDER_NAME: PROVIDER}
    if msg.request_id:
        attributes[REQUEST_ID] = msg.request_id
    return attributes


def _embed_response(msg: Any, attributes: dict[str, Any]) -> None:
    attributes[REQUEST_ID] = msg.request_id
    attributes[NUM_PROMPT_TOKENS] = msg.num_prompt_tokens


def _abort_request(msg: Any) -> dict[str, Any]:
    return {REQUEST_ID: msg.request_id}


_RPC_ATTRIBUTES: dict[str, _Recorded] = {
    "pagedserve.v1.GenerationService/GenerateStream": _Recorded(_generate_request,
                                                                _generate_stream_response),
    "pagedserve.v1.GenerationService/Generate": _Recorded(_generate_request, _generate_response),
    "pagedserve.v1.GenerationService/Abort": _Recorded(_abort_request),
    "pagedserve.v1.GenerationService/Embed": _Recorded(_embed_request, _embed_response),
    # one request of a SubmitStream call (request_span)
    "pagedserve.internal.v1.SchedulerService/SubmitStream": _Recorded(_submit_request,
                                                                      _token_event),
    "pagedserve.internal.v1.SchedulerService/Abort": _Recorded(_abort_request),
    "pagedserve.internal.v1.WorkerService/ExecuteStep": _Recorded(_step_request, _step_result),
}
