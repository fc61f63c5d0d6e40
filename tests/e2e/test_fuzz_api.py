"""Fuzzing the public API (Generate, GenerateStream, Tokenize, Abort) and the internal
Scheduler (Submit, Abort) of a real tiny stack with random, mostly invalid, field values
(hypothesis). Every call must end with OK, INVALID_ARGUMENT, RESOURCE_EXHAUSTED or NOT_FOUND;
afterwards the stack still serves and every block is free.

PAGEDSERVE_FUZZ_EXAMPLES sets the number of examples per test (`make fuzz`: 10,000); the status
codes seen are printed at the end of the module (visible with `pytest -s`).
"""

from __future__ import annotations

import collections
import math
import os

import grpc
import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, given, settings
from pagedserve.services.rpc.internal.v1 import common_pb2 as internal_common_pb2
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle
from tests.e2e.submit_call import SubmitCall

NUM_EXAMPLES = int(os.environ.get("PAGEDSERVE_FUZZ_EXAMPLES", "150"))
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT,
           grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.NOT_FOUND}
CALL_TIMEOUT_S = 60.0
FUZZ_SETTINGS = settings(max_examples=NUM_EXAMPLES, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck))

INT32 = (-(1 << 31), (1 << 31) - 1)
FLOATS = st.one_of(st.floats(-3.0, 3.0), st.sampled_from(
    [0.0, 1e-5, 1.0, -1.0, 5e-324, 1e308, -1e308, math.inf, -math.inf, math.nan, 100.0, 101.0]))
# every value small enough to generate fast, or refused (the gateway's max_num_seqs_per_request,
# the scheduler's max_best_of)
COUNTS = st.one_of(st.integers(-2, 3), st.sampled_from([0, 65, 300, *INT32]))
MAX_TOKENS = st.one_of(st.integers(-2, 12), st.sampled_from([0, 512, 100_000, *INT32]))
TOKEN_IDS = st.one_of(  # mostly inside the tiny model's vocabulary of 512
    st.lists(st.integers(0, 511), min_size=1, max_size=30),
    st.lists(st.integers(0, 511), min_size=1, max_size=30),
    st.lists(st.one_of(st.integers(0, 520), st.just((1 << 32) - 1)), max_size=40))
TEXT = st.text(max_size=60)
REQUEST_IDS = st.one_of(st.just(""), st.uuids().map(str), st.uuids().map(str), TEXT,
                        st.just("x" * 300))


def _optional(strategy):
    return st.one_of(st.none(), strategy)


SANE = {  # values a well-behaved client sends, so that many requests reach the engine
    "n": st.integers(1, 2), "temperature": st.sampled_from([0.0, 0.0, 0.7, 1.0]),
    "top_p": st.sampled_from([1.0, 0.9]), "top_k": st.sampled_from([0, 5]),
    "repetition_penalty": st.sampled_from([1.0, 1.2]), "max_tokens": st.integers(1, 12),
    "min_tokens": st.integers(0, 2), "logprobs": st.integers(0, 3),
    "prompt_logprobs": st.integers(0, 2), "seed": st.integers(0, 9),
    "stop": st.lists(st.sampled_from(["a", "the", "\n"]), max_size=2),
    "length_penalty": st.sampled_from([1.0, 0.5]), "min_p": st.sampled_from([0.0, 0.1]),
}


@st.composite
def sampling_params(draw) -> common_pb2.SamplingParams:
    """Mostly sane requests with at most one wild field (each check is reached), else wild."""
    wild = draw(_wild_sampling_params())
    if draw(st.integers(0, 3)) == 0:
        return wild
    msg = common_pb2.SamplingParams()
    for name, strategy in SANE.items():
        if draw(st.booleans()):
            value = draw(strategy)
            if isinstance(value, list):
                msg.stop[:] = value
            else:
                setattr(msg, name, value)
    wild_fields = [f.name for f, _ in wild.ListFields()]
    if wild_fields and draw(st.booleans()):
        name = draw(st.sampled_from(wild_fields))
        msg.ClearField(name)
        value = getattr(wild, name)
        if name in ("stop", "stop_token_ids"):
            getattr(msg, name).extend(value)
        else:
            setattr(msg, name, value)
    return msg


@st.composite
def _wild_sampling_params(draw) -> common_pb2.SamplingParams:
    fields = {
        "n": draw(_optional(COUNTS)), "best_of": draw(_optional(COUNTS)),
        "use_beam_search": draw(st.booleans()), "length_penalty": draw(_optional(FLOATS)),
        "temperature": draw(_optional(st.one_of(st.just(0.0), FLOATS))),
        "top_p": draw(_optional(FLOATS)), "top_k": draw(_optional(st.integers(-3, 600))),
        "min_p": draw(_optional(FLOATS)), "presence_penalty": draw(_optional(FLOATS)),
        "frequency_penalty": draw(_optional(FLOATS)),
        "repetition_penalty": draw(_optional(FLOATS)),
        "seed": draw(_optional(st.integers(-(1 << 63), (1 << 63) - 1))),
        "stop": draw(_optional(st.one_of(
            st.lists(st.text(max_size=4), max_size=4),
            st.lists(st.text(min_size=1, max_size=3), min_size=65, max_size=80),
            st.just(["x" * 300])))),
        "stop_token_ids": draw(_optional(st.lists(st.integers(0, 600), max_size=4))),
        "include_stop_str_in_output": draw(st.booleans()), "ignore_eos": draw(st.booleans()),
        "max_tokens": draw(_optional(MAX_TOKENS)), "min_tokens": draw(_optional(MAX_TOKENS)),
        "logprobs": draw(_optional(st.integers(-2, 25))),
        "prompt_logprobs": draw(_optional(st.integers(-2, 25))),
        "skip_special_tokens": draw(_optional(st.booleans())),
    }
    return common_pb2.SamplingParams(**{k: v for k, v in fields.items() if v is not None})


CHAT = st.builds(lambda messages: common_pb2.ChatMessages(messages=messages), st.lists(
    st.builds(common_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant", ""]),
              content=TEXT), max_size=3))


@st.composite
def generate_requests(draw) -> gateway_pb2.GenerateRequest:
    prompt = draw(st.sampled_from(["text", "token_ids", "messages", "none"]))
    kw = {}
    if prompt == "text":
        kw["text"] = draw(TEXT)
    elif prompt == "token_ids":
        kw["token_ids"] = common_pb2.TokenIds(token_ids=draw(TOKEN_IDS))
    elif prompt == "messages":
        kw["messages"] = draw(CHAT)
    return gateway_pb2.GenerateRequest(
        request_id=draw(REQUEST_IDS),
        sampling=draw(sampling_params()), priority=draw(st.integers(*INT32)), **kw)


@st.composite
def submit_requests(draw) -> scheduler_pb2.SubmitRequest:
    # the internal SamplingParams has the public one's fields and numbers: the same bytes parse
    sampling = internal_common_pb2.SamplingParams.FromString(
        draw(sampling_params()).SerializeToString())
    return scheduler_pb2.SubmitRequest(
        request_id=draw(REQUEST_IDS),
        prompt_token_ids=draw(TOKEN_IDS), sampling=sampling,
        priority=draw(st.integers(*INT32)), owner=draw(TEXT))


STATUS_COUNTS: collections.Counter[str] = collections.Counter()


@pytest.fixture(scope="module", autouse=True)
def status_counts_report():
    """Set up before the module's stack, so it prints once the stack has closed."""
    yield
    print(f"\nfuzz status codes: {dict(sorted(STATUS_COUNTS.items()))}")


@pytest.fixture(scope="module")
def stubs(stack):
    with grpc.insecure_channel(stack.gateway_address) as gateway, \
            grpc.insecure_channel(stack.scheduler_address) as scheduler:
        yield (gateway_pb2_grpc.GenerationServiceStub(gateway),
               scheduler_pb2_grpc.SchedulerServiceStub(scheduler))


def _call(name: str, fn) -> None:
    """Run one call to its end; fail on any status outside ALLOWED."""
    try:
        fn()
        code = grpc.StatusCode.OK
    except grpc.RpcError as error:
        code = error.code()
        assert code in ALLOWED, f"{name}: {code.name}: {error.details()}"
        assert error.details(), f"{name}: {code.name} without a message"
    STATUS_COUNTS[f"{name} {code.name}"] += 1


@FUZZ_SETTINGS
@given(request=generate_requests(), method=st.sampled_from(
    ["Generate", "GenerateStream", "Tokenize", "Abort"]))
def test_public_api_answers_every_request_with_an_allowed_status(stack, stubs, request, method):
    generation, _ = stubs
    if method == "Generate":
        _call(method, lambda: generation.Generate(request, timeout=CALL_TIMEOUT_S))
    elif method == "GenerateStream":
        _call(method, lambda: list(generation.GenerateStream(request, timeout=CALL_TIMEOUT_S)))
    elif method == "Tokenize":
        prompt = request.WhichOneof("prompt")
        tokenize = gateway_pb2.TokenizeRequest(**(
            {prompt: getattr(request, prompt)} if prompt in ("text", "messages") else {}))
        _call(method, lambda: generation.Tokenize(tokenize, timeout=CALL_TIMEOUT_S))
    else:
        _call(method, lambda: generation.Abort(
            gateway_pb2.AbortRequest(request_id=request.request_id), timeout=CALL_TIMEOUT_S))


@FUZZ_SETTINGS
@given(request=submit_requests(), is_abort=st.booleans(), is_admin=st.booleans())
def test_internal_submit_answers_every_request_with_an_allowed_status(
        stack, stubs, request, is_abort, is_admin):
    _, scheduler = stubs
    if is_abort:
        _call("SchedulerService.Abort", lambda: scheduler.Abort(scheduler_pb2.AbortRequest(
            request_id=request.request_id, owner=request.owner, is_admin=is_admin),
            timeout=CALL_TIMEOUT_S))
    else:
        _call("SchedulerService.SubmitStream", lambda: list(SubmitCall(
            scheduler, request, timeout=CALL_TIMEOUT_S)))


def test_after_the_fuzz_the_stack_serves_and_every_block_is_free(stack, stubs):
    """Runs after the fuzz tests (file order): no service died, nothing leaked."""
    generation, _ = stubs
    response = generation.Generate(gateway_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
        timeout=CALL_TIMEOUT_S)
    assert len(response.outputs[0].token_ids) == 4
    assert not stack.scheduler[1].engine._task.done()  # the engine loop is alive
    assert_idle(stack, timeout_s=10.0)
