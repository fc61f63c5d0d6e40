"""A stop string ends its output in the scheduler, through either front door: with n = 2 the
stopped output is scheduled no more and its blocks are freed while its sibling runs on; with
n = 1 the request finishes there as stopped, not aborted."""

from __future__ import annotations

import grpc
import httpx
import pytest
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle
from tests.scheduled_steps import ScheduledSteps, stop_string

PROMPT = "hello there"
MAX_TOKENS = 64
SAMPLING = {"n": 2, "temperature": 1.0, "seed": 7, "max_tokens": MAX_TOKENS, "ignore_eos": True}


def generate(generation, request_id: str, stop: list[str]) -> gateway_pb2.GenerateResponse:
    return generation.Generate(gateway_pb2.GenerateRequest(
        request_id=request_id, text=PROMPT,
        sampling=common_pb2.SamplingParams(stop=stop, **SAMPLING)), timeout=60)


@pytest.fixture()
def steps(stack) -> ScheduledSteps:
    return ScheduledSteps(stack.scheduler[1].engine.core)


@pytest.fixture(scope="module")
def stop(stack, generation_stub) -> str:
    free = generate(generation_stub, "unstopped", [])
    texts = [o.text for o in free.outputs]
    assert texts[0] != texts[1] and all(len(o.token_ids) == MAX_TOKENS for o in free.outputs)
    return stop_string(texts)


@pytest.fixture(scope="module")
def generation_stub(stack):
    with grpc.insecure_channel(stack.gateway_address) as channel:
        yield gateway_pb2_grpc.GenerationServiceStub(channel)


def test_grpc_door(stack, generation_stub, stop, steps):
    response = generate(generation_stub, "grpc-stop", [stop])
    first, second = response.outputs
    assert first.finish_reason == common_pb2.FINISH_REASON_STOP and first.text == ""
    assert len(second.token_ids) == MAX_TOKENS
    steps.assert_finished_early("grpc-stop", finished=0, sibling=1, min_steps_after=20)
    assert_idle(stack)


def test_http_door(stack, stop, steps):
    body = {"prompt": PROMPT, "stop": [stop], **SAMPLING}
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    assert [c["finish_reason"] for c in choices] == ["stop", "length"]
    request_ids = {request_id for step in steps.steps for request_id, _ in step.ran}
    request_id, = request_ids
    steps.assert_finished_early(request_id, finished=0, sibling=1, min_steps_after=20)
    assert_idle(stack)


class FinishReasons:
    """A stat logger of the scheduler's engine: why each request finished there."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def record_step(self, stats) -> None:
        pass

    def record_finished(self, stats) -> None:
        self.reasons.append(stats.finish_reason)


def test_the_last_output_stopped_finishes_the_request_as_stopped(stack, generation_stub):
    greedy = common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    free = generation_stub.Generate(gateway_pb2.GenerateRequest(
        request_id="greedy", text=PROMPT, sampling=greedy), timeout=60)
    engine = stack.scheduler[1].engine.core
    finished = FinishReasons()
    engine.stat_loggers.append(finished)
    greedy.stop.append(free.outputs[0].text[:4])
    try:
        stopped = generation_stub.Generate(gateway_pb2.GenerateRequest(
            request_id="greedy-stop", text=PROMPT, sampling=greedy), timeout=60)
        assert stopped.outputs[0].finish_reason == common_pb2.FINISH_REASON_STOP
        assert_idle(stack)
    finally:
        engine.stat_loggers.remove(finished)
    assert finished.reasons == ["stop"]
