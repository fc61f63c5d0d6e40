"""One trace across the services: a request's spans in the gateway, the scheduler and the worker
(real gRPC over loopback, one process) share the trace id of the caller's span, each parented by
the span that made the call."""

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode
from pagedserve.scheduler_svc.async_engine import STEP_SPAN
from pagedserve.services.common.config import served_model_name
from pagedserve.services.rpc.tracing import inject_metadata
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.test_finish_sequence import PROMPT, SAMPLING, generate
from tests.scheduled_steps import ScheduledSteps, stop_string

GENERATE_STREAM = "pagedserve.v1.GenerationService/GenerateStream"
SUBMIT = "pagedserve.internal.v1.SchedulerService/SubmitStream"  # one request's spans
EXECUTE_STEP = "pagedserve.internal.v1.WorkerService/ExecuteStep"
CALLER = TracerProvider().get_tracer("caller")  # the client's own tracing, apart from ours
MODEL_NAME = "tiny-llama"  # the served model folder's name


_EXPORTER: list[InMemorySpanExporter] = []  # the module's, for helpers


@pytest.fixture(scope="module")
def exporter():
    """Spans of this module's tests, on the process's SDK provider (installed here unless
    tracing was set up already: a process has one global provider)."""
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    _EXPORTER[:] = [exporter]
    yield exporter
    exporter.shutdown()  # keeps no spans of later tests


@pytest.fixture(scope="module")
def stack_options(exporter):
    """The stack starts after the exporter is installed."""
    return {}


@pytest.fixture()
def generation(stack, exporter):
    exporter.clear()  # startup's handshake spans, earlier tests' spans
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def request(prompt: list[int], request_id: str = "", **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(request_id=request_id,
                                       token_ids=common_pb2.TokenIds(token_ids=prompt),
                                       sampling=common_pb2.SamplingParams(**sampling))


def wait_for_spans(exporter, trace_ids: set[int], done,
                   timeout_s: float = 5.0) -> list[ReadableSpan]:
    """The finished spans of these traces, once `done(spans)`: spans end a little after the
    caller saw its answer (the services finish their calls)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id in trace_ids]
        if done(spans) or time.monotonic() > deadline:
            return spans
        time.sleep(0.02)


def named(spans, name: str, kind: SpanKind | None = None) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name and (kind is None or s.kind == kind)]


def one(spans, name: str, kind: SpanKind) -> ReadableSpan:
    found = named(spans, name, kind)
    assert len(found) == 1, f"{len(found)} {kind.name} spans named {name}: {found}"
    return found[0]


def test_one_stream_is_one_trace_from_the_caller_down_to_the_worker(stack, generation, exporter):
    prompt = [1, 57, 300, 12, 99, 401, 7]
    max_tokens = 4
    with CALLER.start_as_current_span("client") as client_span:
        responses = list(generation.GenerateStream(
            request(prompt, "traced-1", temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
            metadata=inject_metadata(None), timeout=30))
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    trace_id = client_span.get_span_context().trace_id
    spans = wait_for_spans(exporter, {trace_id},
                           lambda spans: len(named(spans, STEP_SPAN)) >= max_tokens
                           and len(named(spans, SUBMIT)) == 2
                           and named(spans, GENERATE_STREAM, SpanKind.SERVER))

    # the prefill (the first token) and a decode for each other token, each one step span and
    # one worker call: no step is sent for a sequence whose last token is being computed
    num_steps = max_tokens
    assert len(spans) == 3 + 3 * num_steps  # nothing else in the trace
    gateway = one(spans, GENERATE_STREAM, SpanKind.SERVER)
    submit_out = one(spans, SUBMIT, SpanKind.CLIENT)
    submit_in = one(spans, SUBMIT, SpanKind.SERVER)
    assert gateway.parent.span_id == client_span.get_span_context().span_id
    assert submit_out.parent.span_id == gateway.context.span_id
    assert submit_in.parent.span_id == submit_out.context.span_id

    steps = sorted(named(spans, STEP_SPAN), key=lambda s: s.start_time)
    assert len(steps) == num_steps
    assert all(s.parent.span_id == submit_in.context.span_id for s in steps)
    step_ids = [s.attributes["pagedserve.step_id"] for s in steps]
    assert step_ids == sorted(set(step_ids))
    calls = named(spans, EXECUTE_STEP, SpanKind.CLIENT)
    served = named(spans, EXECUTE_STEP, SpanKind.SERVER)
    assert len(calls) == len(served) == num_steps
    for step in steps:
        call = next(c for c in calls if c.parent.span_id == step.context.span_id)
        execution = next(s for s in served if s.parent.span_id == call.context.span_id)
        assert execution.attributes["pagedserve.step_id"] == step.attributes["pagedserve.step_id"]
        assert execution.attributes["pagedserve.forward_ns"] > 0
        assert (execution.start_time >= call.start_time >= step.start_time
                and execution.end_time <= call.end_time <= step.end_time)
    assert steps[0].attributes["pagedserve.num_scheduled_tokens"] == len(prompt)
    assert ([s.attributes["pagedserve.num_scheduled_tokens"] for s in steps[1:]]
            == [1] * (max_tokens - 1))
    assert {(s.attributes["pagedserve.num_seqs"], s.attributes["pagedserve.num_preempted"])
            for s in steps} == {(1, 0)}

    # what each hop recorded about the request, on OpenTelemetry's GenAI conventions
    for span in (gateway, submit_out, submit_in):
        assert span.attributes["gen_ai.operation.name"] == "text_completion"
        assert span.attributes["gen_ai.provider.name"] == "pagedserve"
        assert span.attributes["gen_ai.response.id"] == "traced-1"
        assert span.attributes["gen_ai.request.max_tokens"] == max_tokens
        assert span.attributes["gen_ai.request.temperature"] == 0.0
        assert span.status.status_code == StatusCode.UNSET
    model = served_model_name(stack.scheduler[1].model)
    assert gateway.attributes["gen_ai.request.model"] == submit_in.attributes[
        "gen_ai.request.model"] == model
    assert gateway.attributes["rpc.response.status_code"] == "OK"
    assert gateway.attributes["pagedserve.routing.replica"] == stack.scheduler_address
    assert gateway.attributes["pagedserve.routing.reason"] == "short_prompt"
    assert gateway.attributes["pagedserve.routing.num_failovers"] == 0
    # the gateway leaves the request as soon as its last event came, maybe before its end did
    assert submit_out.attributes["rpc.response.status_code"] in {"OK", "CANCELLED"}
    assert submit_in.attributes["rpc.response.status_code"] == "OK"
    assert gateway.attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert gateway.attributes["gen_ai.usage.output_tokens"] == max_tokens
    assert gateway.attributes["gen_ai.usage.cache_read.input_tokens"] == 0
    assert submit_out.attributes["gen_ai.usage.input_tokens"] == len(prompt)
    assert submit_out.attributes["gen_ai.request.choice.count"] == 1
    assert submit_in.attributes["gen_ai.usage.cache_read.input_tokens"] == 0
    assert submit_in.attributes["gen_ai.usage.output_tokens"] == max_tokens
    assert submit_in.attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert gateway.attributes["gen_ai.response.finish_reasons"] == ("length",)
    for span in (gateway, submit_in):
        assert [e.name for e in span.events] == ["gen_ai.first_token"]
        assert 0 < span.attributes["gen_ai.response.time_to_first_chunk"] < (
            span.end_time - span.start_time) / 1e9


def test_a_step_of_two_requests_lives_in_one_trace_and_links_the_other(generation, exporter):
    def generate(request_id: str) -> int:
        with CALLER.start_as_current_span(request_id) as caller_span:
            response = generation.Generate(
                request([1, 2, 3, 4, 5], request_id, temperature=0.0, max_tokens=12,
                        ignore_eos=True), metadata=inject_metadata(None), timeout=30)
        assert len(response.outputs[0].token_ids) == 12
        return caller_span.get_span_context().trace_id

    with ThreadPoolExecutor(2) as pool:
        trace_ids = set(pool.map(generate, ["pair-a", "pair-b"]))
    spans = wait_for_spans(exporter, trace_ids, lambda spans: len(named(spans, SUBMIT)) == 4)

    submits = {s.attributes["gen_ai.response.id"]: s
               for s in named(spans, SUBMIT, SpanKind.SERVER)}
    assert {s.context.trace_id for s in submits.values()} == trace_ids
    shared = [s for s in named(spans, STEP_SPAN) if s.attributes["pagedserve.num_seqs"] == 2]
    assert shared, "the two requests never ran in the same step"
    for step in shared:
        parent = next(s for s in submits.values() if s.context.span_id == step.parent.span_id)
        other = next(s for s in submits.values() if s is not parent)
        assert step.context.trace_id == parent.context.trace_id
        assert [link.context.span_id for link in step.links] == [other.context.span_id]


def test_a_bad_request_is_recorded_with_its_status_but_is_no_server_error(generation, exporter):
    with CALLER.start_as_current_span("bad") as caller_span, \
            pytest.raises(grpc.RpcError) as failure:
        generation.GenerateStream(request([1, 2, 3], temperature=-1.0),
                                  metadata=inject_metadata(None), timeout=10).next()
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    spans = wait_for_spans(exporter, {caller_span.get_span_context().trace_id},
                           lambda spans: named(spans, GENERATE_STREAM))
    gateway = one(spans, GENERATE_STREAM, SpanKind.SERVER)
    assert gateway.attributes["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert gateway.status.status_code == StatusCode.UNSET  # the caller's fault, per the convention
    assert len(spans) == 1  # it never reached the scheduler


def test_a_traced_request_ends_a_stopped_output_in_the_scheduler(stack, generation, exporter):
    """Traced requests share the SubmitStream call too, so a stop string finishes its output
    there as for any other request."""
    free = generate(generation, "traced-free", [])
    stop = stop_string([o.text for o in free.outputs])
    steps = ScheduledSteps(stack.scheduler[1].engine.core)
    with CALLER.start_as_current_span("stop") as caller_span:
        response = generation.Generate(
            gateway_pb2.GenerateRequest(request_id="traced-stop", text=PROMPT,
                                        sampling=common_pb2.SamplingParams(stop=[stop],
                                                                           **SAMPLING)),
            metadata=inject_metadata(None), timeout=60)
    assert [o.finish_reason for o in response.outputs] == [
        common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH]
    steps.assert_finished_early("traced-stop", finished=0, sibling=1, min_steps_after=20)
    spans = wait_for_spans(exporter, {caller_span.get_span_context().trace_id},
                           lambda spans: len(named(spans, SUBMIT)) == 2)
    assert one(spans, SUBMIT, SpanKind.SERVER).attributes["gen_ai.response.id"] == "traced-stop"


def http_traced(stack, path: str, body: dict, name: str):
    """POST `body` with the caller's traceparent: (the caller's span, the trace's spans once the
    HTTP span and the scheduler's span of each request ended)."""
    with CALLER.start_as_current_span(name) as caller_span:
        headers = dict(inject_metadata(None))
        response = httpx.post(f"{stack.http_url}{path}", json=body, headers=headers, timeout=60)
    response.raise_for_status()
    spans = wait_for_spans(_EXPORTER[0], {caller_span.get_span_context().trace_id},
                           lambda spans: named(spans, SUBMIT, SpanKind.SERVER)
                           and any(s.kind == SpanKind.SERVER and s.name.endswith(MODEL_NAME)
                                   for s in spans))
    return caller_span, response.json(), spans


def test_an_http_request_continues_the_callers_trace_down_to_the_worker(stack, generation,
                                                                         exporter):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    caller_span, answer, spans = http_traced(stack, "/v1/chat/completions", body, "http-chat")
    http = one(spans, f"chat {MODEL_NAME}", SpanKind.SERVER)
    submit_out = one(spans, SUBMIT, SpanKind.CLIENT)
    submit_in = one(spans, SUBMIT, SpanKind.SERVER)
    assert http.parent.span_id == caller_span.get_span_context().span_id
    assert submit_out.parent.span_id == http.context.span_id
    assert submit_in.parent.span_id == submit_out.context.span_id
    assert named(spans, STEP_SPAN) and named(spans, EXECUTE_STEP, SpanKind.SERVER)
    assert [s for s in spans if s.kind == SpanKind.SERVER and s.parent.span_id
            == caller_span.get_span_context().span_id] == [http]  # one HTTP server span
    attributes = http.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.provider.name"] == "pagedserve"
    assert attributes["gen_ai.request.model"] == MODEL_NAME
    assert attributes["gen_ai.response.id"] == answer["id"]
    assert attributes["gen_ai.request.max_tokens"] == 3
    assert attributes["gen_ai.usage.input_tokens"] == answer["usage"]["prompt_tokens"]
    assert attributes["gen_ai.usage.output_tokens"] == 3
    assert attributes["gen_ai.response.finish_reasons"] == ("length",)
    assert attributes["http.response.status_code"] == 200
    assert http.status.status_code == StatusCode.UNSET


def test_http_embeddings_and_completions_are_traced_by_their_operation(stack, generation,
                                                                        exporter):
    _, answer, spans = http_traced(stack, "/v1/embeddings",
                                   {"input": [[5, 6, 7], [8, 9]]}, "http-embed")
    http = one(spans, f"embeddings {MODEL_NAME}", SpanKind.SERVER)
    assert http.attributes["gen_ai.operation.name"] == "embeddings"
    assert http.attributes["gen_ai.usage.input_tokens"] == 5
    assert {s.attributes["gen_ai.operation.name"]
            for s in named(spans, SUBMIT)} == {"embeddings"}
    assert all(s.parent.span_id == http.context.span_id
               for s in named(spans, SUBMIT, SpanKind.CLIENT))
    _, answer, spans = http_traced(stack, "/v1/completions", {
        "prompt": [[5, 6], [7, 8]], "max_tokens": 2, "ignore_eos": True}, "http-complete")
    http = one(spans, f"text_completion {MODEL_NAME}", SpanKind.SERVER)
    assert http.attributes["gen_ai.usage.output_tokens"] == 4  # both prompts
    assert http.attributes["gen_ai.response.finish_reasons"] == ("length", "length")


def test_a_refused_http_request_is_the_clients_fault(stack, generation, exporter):
    with CALLER.start_as_current_span("http-bad") as caller_span:
        response = httpx.post(f"{stack.http_url}/v1/completions", timeout=60,
                              headers=dict(inject_metadata(None)),
                              json={"prompt": "x", "temperature": -1})
    assert response.status_code == 400
    spans = wait_for_spans(exporter, {caller_span.get_span_context().trace_id},
                           lambda spans: bool(spans))
    http = one(spans, f"text_completion {MODEL_NAME}", SpanKind.SERVER)
    assert http.attributes["http.response.status_code"] == 400
    assert http.status.status_code == StatusCode.UNSET


def test_a_constrained_request_is_traced_with_its_kind_and_its_steps_mask_wait(stack, generation,
                                                                               exporter):
    _, answer, spans = http_traced(stack, "/v1/completions", {
        "prompt": [5, 6, 7], "max_tokens": 3, "structured_outputs": {"regex": "[a-z]+"}},
        "http-constrained")
    http = one(spans, f"text_completion {MODEL_NAME}", SpanKind.SERVER)
    assert http.attributes["pagedserve.structured_output"] == "regex"
    executions = named(spans, EXECUTE_STEP, SpanKind.SERVER)
    assert executions and all(s.attributes["pagedserve.mask_ns"] > 0 for s in executions)
