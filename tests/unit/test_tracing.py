"""services/rpc/tracing.py: W3C trace context through gRPC metadata, the server and client
interceptors over real loopback gRPC (each test with its own TracerProvider and in-memory
exporter, so nothing global changes), the exporters and the tracing flags."""

import asyncio
import os
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pagedserve.services.common.config import TracingConfig, from_args
from pagedserve.services.common.errors import ConfigError, InvalidRequest
from pagedserve.services.gateway.config import GatewayConfig
from pagedserve.services.rpc.internal.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pagedserve.services.rpc.status import map_errors
from pagedserve.services.rpc.tracing import (
    ClientTracingInterceptor,
    ServerTracingInterceptor,
    aio_client_interceptors,
    extract_context,
    inject_metadata,
)
from pagedserve.services.rpc.tracing_setup import (
    TracingSettings,
    build_tracer_provider,
    tracing_settings,
)
from pagedserve.services.rpc.v1 import common_pb2 as public_common_pb2
from pagedserve.services.rpc.v1 import gateway_pb2, gateway_pb2_grpc

from pagedserve.cli import build_parser

GENERATE_STREAM = "pagedserve.v1.GenerationService/GenerateStream"
LENGTH = public_common_pb2.FINISH_REASON_LENGTH


def recording_provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_inject_then_extract_continues_the_same_trace():
    provider, _ = recording_provider()
    with provider.get_tracer("test").start_as_current_span("caller") as span:
        metadata = inject_metadata([("x-other", "kept")])
    assert metadata[0] == ("x-other", "kept")
    assert dict(metadata)["traceparent"].startswith("00-")
    extracted = trace.get_current_span(extract_context(metadata)).get_span_context()
    assert extracted.trace_id == span.get_span_context().trace_id
    assert extracted.span_id == span.get_span_context().span_id
    assert extracted.is_remote


def test_without_a_current_span_nothing_is_sent_and_nothing_is_found():
    assert inject_metadata(None) == []
    assert not trace.get_current_span(extract_context(None)).get_span_context().is_valid
    assert not trace.get_current_span(
        extract_context([("traceparent", "garbage")])).get_span_context().is_valid


class Generation(gateway_pb2_grpc.GenerationServiceServicer):
    """GenerateStream streams three one-token responses (or hangs after the first for request
    "hang")."""

    def __init__(self):
        self.traceparents: list[str | None] = []
        self.current_spans: list[trace.Span] = []
        self.closed = asyncio.Event()

    @map_errors
    async def GenerateStream(self, request, context):
        self.traceparents.append(dict(context.invocation_metadata()).get("traceparent"))
        try:
            for i in range(3):
                self.current_spans.append(trace.get_current_span())
                response = gateway_pb2.GenerateStreamResponse(
                    request_id=request.request_id, index=0, token_ids=[i])
                if i == 2:
                    response.finish_reason = LENGTH
                    response.usage.prompt_tokens = len(request.token_ids.token_ids)
                    response.usage.completion_tokens = 3
                    response.usage.cached_tokens = 2
                yield response
                if request.request_id == "hang":
                    await asyncio.Event().wait()
        finally:
            self.closed.set()


class Scheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    @map_errors
    async def Abort(self, request, context):
        raise InvalidRequest(f"request_id must not be empty, got {request.request_id!r}")

    @map_errors
    async def GetLoad(self, request, context):
        raise RuntimeError("the load is unknowable")

    async def GetServedModel(self, request, context):  # no map_errors: gRPC answers UNKNOWN
        raise KeyError("model")


class Worker(worker_pb2_grpc.WorkerServiceServicer):
    async def ExecuteStep(self, request, context):
        return worker_pb2.ExecuteStepResponse(
            step_id=request.step_id,
            timings=worker_pb2.StepTimings(cache_ops_ns=1, prepare_ns=2, forward_ns=3, sample_ns=4,
                                           mask_ns=5))


async def start_server(provider) -> tuple[grpc.aio.Server, str, Generation]:
    server = grpc.aio.server(interceptors=[ServerTracingInterceptor(provider)])
    generation = Generation()
    gateway_pb2_grpc.add_GenerationServiceServicer_to_server(generation, server)
    scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server(Scheduler(), server)
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(Worker(), server)
    health_pb2_grpc.add_HealthServicer_to_server(health_aio.HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", generation


async def finished(exporter, count: int, timeout_s: float = 5.0) -> list:
    """The client span ends a moment after the call (its status is read asynchronously)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(exporter.get_finished_spans()) < count:
        assert asyncio.get_running_loop().time() < deadline, exporter.get_finished_spans()
        await asyncio.sleep(0.01)
    return list(exporter.get_finished_spans())


def by_kind(spans, kind: SpanKind):
    [span] = [s for s in spans if s.kind == kind]
    return span


def generate_request(request_id: str) -> gateway_pb2.GenerateStreamRequest:
    return gateway_pb2.GenerateStreamRequest(
        request_id=request_id, token_ids=public_common_pb2.TokenIds(token_ids=[5, 6, 7, 8]),
        sampling=public_common_pb2.SamplingParams(
            n=1, max_tokens=3, structured_outputs=public_common_pb2.StructuredOutputs(
                regex="[a-z]+")))


def test_a_stream_is_a_client_span_and_a_server_span_of_the_caller_trace():
    provider, exporter = recording_provider()

    async def main():
        server, address, generation = await start_server(provider)
        async with grpc.aio.insecure_channel(
                address, interceptors=aio_client_interceptors(address, provider)) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            with provider.get_tracer("test").start_as_current_span("caller") as caller:
                events = [event async for event in stub.GenerateStream(generate_request("r-1"))]
            spans = await finished(exporter, 3)
        await server.stop(0)
        return caller, events, spans, generation

    caller, events, spans, generation = asyncio.run(main())
    assert len(events) == 3
    client, served = by_kind(spans, SpanKind.CLIENT), by_kind(spans, SpanKind.SERVER)
    assert client.name == served.name == GENERATE_STREAM
    assert {s.context.trace_id for s in spans} == {caller.get_span_context().trace_id}
    assert client.parent.span_id == caller.get_span_context().span_id
    assert served.parent.span_id == client.context.span_id
    assert generation.traceparents[0].split("-")[2] == format(client.context.span_id, "016x")
    # the handler runs inside the server span, between every response too
    assert {s.get_span_context().span_id for s in generation.current_spans} == {
        served.context.span_id}
    assert served.end_time >= client.start_time and served.start_time >= client.start_time

    for span in (client, served):
        assert span.attributes["rpc.system.name"] == "grpc"
        assert span.attributes["rpc.method"] == GENERATE_STREAM
        assert span.attributes["rpc.response.status_code"] == "OK"
        assert "rpc.service" not in span.attributes and "rpc.system" not in span.attributes
        assert span.attributes["gen_ai.operation.name"] == "text_completion"
        assert span.attributes["gen_ai.response.id"] == "r-1"
        assert (span.attributes["gen_ai.request.choice.count"],
                span.attributes["gen_ai.request.max_tokens"]) == (1, 3)
        assert span.attributes["pagedserve.structured_output"] == "regex"
        assert span.status.status_code == StatusCode.UNSET
    assert client.attributes["server.port"] == int(client.attributes["server.port"])
    assert served.attributes["gen_ai.usage.input_tokens"] == 4  # from the last response
    assert served.attributes["gen_ai.usage.output_tokens"] == 3
    assert served.attributes["gen_ai.usage.cache_read.input_tokens"] == 2
    assert served.attributes["gen_ai.response.finish_reasons"] == ("length",)
    (first_token,) = served.events
    assert first_token.name == "gen_ai.first_token"
    assert served.attributes["gen_ai.response.time_to_first_chunk"] == pytest.approx(
        (first_token.timestamp - served.start_time) / 1e9)


@pytest.mark.parametrize(("method", "request_msg", "code", "server_status", "has_exception"), [
    ("Abort", scheduler_pb2.AbortRequest(), grpc.StatusCode.INVALID_ARGUMENT, StatusCode.UNSET,
     False),
    ("GetLoad", scheduler_pb2.GetLoadRequest(), grpc.StatusCode.INTERNAL, StatusCode.ERROR,
     False),
    ("GetServedModel", scheduler_pb2.GetServedModelRequest(), grpc.StatusCode.UNKNOWN,
     StatusCode.ERROR, True),
])
def test_a_failed_call_records_its_status(method, request_msg, code, server_status,
                                          has_exception):
    """The server span is an error only when the server is at fault (OpenTelemetry's RPC
    conventions); the client span of any failed call is."""
    provider, exporter = recording_provider()

    async def main():
        server, address, _ = await start_server(provider)
        async with grpc.aio.insecure_channel(
                address, interceptors=aio_client_interceptors(address, provider)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as failure:
                await getattr(scheduler_pb2_grpc.SchedulerServiceStub(channel), method)(request_msg)
            spans = await finished(exporter, 2)
        await server.stop(0)
        return failure.value, spans

    error, spans = asyncio.run(main())
    assert error.code() == code
    client, served = by_kind(spans, SpanKind.CLIENT), by_kind(spans, SpanKind.SERVER)
    assert client.attributes["rpc.response.status_code"] == served.attributes[
        "rpc.response.status_code"] == code.name
    assert client.attributes["error.type"] == code.name
    assert client.status.status_code == StatusCode.ERROR
    assert client.status.description.startswith(code.name)
    assert served.status.status_code == server_status
    assert any(e.name == "exception" for e in served.events) == has_exception


def test_a_stream_the_client_cancels_ends_both_spans_cancelled_not_failed():
    provider, exporter = recording_provider()

    async def main():
        server, address, generation = await start_server(provider)
        async with grpc.aio.insecure_channel(
                address, interceptors=aio_client_interceptors(address, provider)) as channel:
            call = gateway_pb2_grpc.GenerationServiceStub(channel).GenerateStream(
                generate_request("hang"))
            await call.read()
            call.cancel()
            await asyncio.wait_for(generation.closed.wait(), 5)  # the handler was closed
            spans = await finished(exporter, 2)
        await server.stop(0)
        return spans

    spans = asyncio.run(main())
    for span in spans:
        assert span.attributes["rpc.response.status_code"] == "CANCELLED"
        assert span.status.status_code == StatusCode.UNSET


def test_health_checks_are_not_traced():
    provider, exporter = recording_provider()

    async def main():
        server, address, _ = await start_server(provider)
        async with grpc.aio.insecure_channel(
                address, interceptors=aio_client_interceptors(address, provider)) as channel:
            await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        await server.stop(0)

    asyncio.run(main())
    assert exporter.get_finished_spans() == ()


def test_the_sync_client_continues_the_trace_of_its_thread():
    """The scheduler's worker clients are synchronous and called on the engine thread, where
    the engine step span is current."""
    provider, exporter = recording_provider()
    step = worker_pb2.ExecuteStepRequest(step_id=7, new_seqs=[
        worker_pb2.NewSequence(seq_id=1, request_id="r", num_scheduled_tokens=5)],
        running_seqs=[worker_pb2.RunningSequence(seq_id=2, num_scheduled_tokens=1)])

    def execute_step(address: str) -> worker_pb2.ExecuteStepResponse:
        interceptor = ClientTracingInterceptor(address, provider)
        with grpc.intercept_channel(grpc.insecure_channel(address), interceptor) as channel:
            return worker_pb2_grpc.WorkerServiceStub(channel).ExecuteStep(step, timeout=5,
                                                                   wait_for_ready=True)

    async def main():
        server, address, _ = await start_server(provider)
        with provider.get_tracer("test").start_as_current_span("engine_step") as step_span:
            result = await asyncio.to_thread(execute_step, address)
        spans = await finished(exporter, 3)
        await server.stop(0)
        return step_span, result, spans

    step_span, result, spans = asyncio.run(main())
    assert result.step_id == 7
    client, served = by_kind(spans, SpanKind.CLIENT), by_kind(spans, SpanKind.SERVER)
    assert client.parent.span_id == step_span.get_span_context().span_id
    assert served.parent.span_id == client.context.span_id
    for span in (client, served):
        assert span.name == "pagedserve.internal.v1.WorkerService/ExecuteStep"
        assert (span.attributes["pagedserve.step_id"], span.attributes["pagedserve.num_seqs"],
                span.attributes["pagedserve.num_scheduled_tokens"]) == (7, 2, 6)
    assert [served.attributes[f"pagedserve.{name}"]
            for name in ("cache_ops_ns", "prepare_ns", "forward_ns", "sample_ns", "mask_ns")
            ] == [1, 2, 3, 4, 5]


def test_tracing_off_sends_no_context_and_records_nothing():
    off = trace.NoOpTracerProvider()

    async def main():
        server, address, generation = await start_server(off)
        async with grpc.aio.insecure_channel(
                address, interceptors=aio_client_interceptors(address, off)) as channel:
            events = [e async for e in gateway_pb2_grpc.GenerationServiceStub(
                channel).GenerateStream(generate_request("r-off"))]
        await server.stop(0)
        return events, generation

    events, generation = asyncio.run(main())
    assert len(events) == 3
    assert generation.traceparents == [None]
    assert not any(s.is_recording() or s.get_span_context().is_valid
                   for s in generation.current_spans)


# --- setup and flags ----------------------------------------------------------------------------


def settings(env: dict[str, str], **flags) -> TracingSettings:
    return tracing_settings(TracingConfig(**flags), "gateway", env)


def test_tracing_is_off_by_default_and_none_builds_no_provider():
    assert settings({}) == TracingSettings((), "", "pagedserve-gateway")
    assert build_tracer_provider(settings({})) is None
    assert build_tracer_provider(settings({"OTEL_TRACES_EXPORTER": "none"})) is None


def test_otel_variables_alone_turn_tracing_on():
    env = {"OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_SERVICE_NAME": "gw-a",
           "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    assert settings(env) == TracingSettings(("otlp", "console"), "", "gw-a")
    provider = build_tracer_provider(settings(env))
    assert provider.resource.attributes["service.name"] == "gw-a"
    assert provider.get_tracer("t").start_span("s").is_recording()
    provider.shutdown()


def test_flags_override_the_otel_variables():
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "from-env"}
    assert settings(env, otel_exporter="none") == TracingSettings((), "", "from-env")
    assert settings(env, otel_exporter="console", service_name="gw-1") == TracingSettings(
        ("console",), "", "gw-1")
    assert settings({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}).exporters == ()


def test_an_unknown_otel_exporter_is_a_config_error_naming_the_variable():
    with pytest.raises(ConfigError, match="OTEL_TRACES_EXPORTER .* got 'jaeger'"):
        settings({"OTEL_TRACES_EXPORTER": "jaeger"})


def test_setup_tracing_installs_one_global_provider_and_none_leaves_the_no_op_tracer():
    """In a fresh interpreter (a process has one global provider), configured by the OTEL_*
    variables only, read when setup runs: OTEL_TRACES_EXPORTER=none installs nothing and servers
    and channels get no interceptors; console installs a provider once, sampled by
    OTEL_TRACES_SAMPLER."""
    script = """
import os
from opentelemetry import trace
from pagedserve.services.common.config import TracingConfig
from pagedserve.services.rpc.tracing import (aio_client_interceptors, client_interceptors,
                                             server_interceptors)
from pagedserve.services.rpc.tracing_setup import setup_tracing, tracing_settings
def num_interceptors():
    return [len(server_interceptors()), len(aio_client_interceptors("h:1")),
            len(client_interceptors("h:1"))]
os.environ["OTEL_TRACES_EXPORTER"] = "none"
assert setup_tracing(tracing_settings(TracingConfig(), "gateway")) is None
assert not trace.get_tracer("t").start_span("off").is_recording()
assert num_interceptors() == [0, 0, 0]
os.environ["OTEL_TRACES_EXPORTER"] = "console"
os.environ["OTEL_TRACES_SAMPLER"] = "always_on"
provider = setup_tracing(tracing_settings(TracingConfig(), "gateway"))
assert setup_tracing(tracing_settings(TracingConfig(), "other")) is provider
assert provider is trace.get_tracer_provider()
assert type(provider.sampler).__name__ == "StaticSampler"
assert num_interceptors() == [1, 2, 1]
trace.get_tracer("t").start_span("printed").end()
provider.shutdown()
"""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    done = subprocess.run([sys.executable, "-c", script], cwd=root, capture_output=True,
                          text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert '"name": "printed"' in done.stdout and '"name": "off"' not in done.stdout
    assert '"service.name": "pagedserve-gateway"' in done.stdout


def test_tracing_flags_build_the_tracing_config():
    args = build_parser().parse_args(["gateway", "--otel-exporter", "otlp", "--otel-endpoint",
                                      "http://collector:4317", "--service-name", "gw-1"])
    assert from_args(GatewayConfig, args).tracing == TracingConfig(
        otel_exporter="otlp", otel_endpoint="http://collector:4317", service_name="gw-1")
    assert GatewayConfig().tracing.otel_exporter == ""


def test_bad_tracing_config_names_the_field_and_value():
    with pytest.raises(ConfigError, match="otel_exporter must be one of .* got 'jaeger'"):
        TracingConfig(otel_exporter="jaeger")
    with pytest.raises(ConfigError, match="otel_endpoint=.*http://c:4317.*otel_exporter='none'"):
        TracingConfig(otel_exporter="none", otel_endpoint="http://c:4317")
