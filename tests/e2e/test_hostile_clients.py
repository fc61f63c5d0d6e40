"""Clients that call the internal Scheduler directly, abort other callers' requests, or reach
the worker port: each is refused with a status naming the problem, and the stack keeps serving
everyone else."""

import dataclasses
import math
import time

import grpc
import pytest
from pagedserve.services.gateway.config import AdminConfig
from pagedserve.services.rpc.internal.v1 import common_pb2 as internal_common_pb2
from pagedserve.services.rpc.internal.v1 import (
    scheduler_pb2,
    worker_pb2,
    worker_pb2_grpc,
)
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2

from tests.e2e.stack import assert_idle
from tests.e2e.submit_call import SubmitCall

ADMIN_TOKEN = "let-me-in"
ABORT = common_pb2.FINISH_REASON_ABORT
LONG = dict(temperature=0.0, max_tokens=400, ignore_eos=True)


@pytest.fixture(scope="module")
def stack_config(stack_config):
    return dataclasses.replace(stack_config, scheduler=dataclasses.replace(
        stack_config.scheduler, max_num_seqs=2, max_best_of=2, max_waiting_requests=3))


@pytest.fixture(scope="module")
def stack_options():
    return {"admin": AdminConfig(admin_token=ADMIN_TOKEN)}


def submit(request_id="r", prompt=(1, 2, 3), **sampling) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(request_id=request_id, prompt_token_ids=list(prompt),
                                       sampling=internal_common_pb2.SamplingParams(**sampling))


@pytest.mark.parametrize("msg, field", [
    (submit(max_tokens=100_000), "max_model_len"),
    (submit(request_id=""), "request_id"),
    (submit(request_id="x" * 300), "request_id"),
    (submit(prompt=()), "prompt_token_ids"),
    (submit(prompt=(1, 512)), "prompt_token_ids"),
    (submit(n=3, temperature=1.0), "max_best_of=2"),
    (submit(temperature=math.inf), "temperature"),
    (submit(temperature=math.nan), "temperature"),
    (submit(repetition_penalty=5e-324), "repetition_penalty"),
    (submit(length_penalty=math.nan), "length_penalty"),
    (submit(stop_token_ids=[512]), "stop_token_ids"),
], ids=["max-tokens", "empty-id", "long-id", "empty-prompt", "token-id", "best-of",
        "temperature-inf", "temperature-nan", "repetition-penalty", "length-penalty",
        "stop-token-id"])
def test_direct_submit_is_checked_as_the_gateway_checks(stack, scheduler, msg, field):
    with pytest.raises(grpc.RpcError) as error:
        list(SubmitCall(scheduler, msg, timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in error.value.details()
    assert_idle(stack)


def test_a_live_request_id_cannot_be_submitted_twice(stack, scheduler):
    first = SubmitCall(scheduler, submit("dup", **LONG), timeout=60)
    next(first)
    with pytest.raises(grpc.RpcError) as error:
        list(SubmitCall(scheduler, submit("dup", max_tokens=2), timeout=10))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "already in use" in error.value.details()
    first.cancel()
    assert_idle(stack)


def test_a_full_waiting_queue_is_resource_exhausted(stack, scheduler):
    calls = [SubmitCall(scheduler, submit(f"run{i}", **LONG), timeout=60) for i in range(2)]
    _wait_for(stack, lambda load: load.num_running_requests == 2)  # max_num_seqs
    calls += [SubmitCall(scheduler, submit(f"wait{i}", **LONG), timeout=60) for i in range(3)]
    _wait_for(stack, lambda load: load.num_waiting_requests == 3)
    with pytest.raises(grpc.RpcError) as error:
        list(SubmitCall(scheduler, submit("one-too-many", max_tokens=2), timeout=10))
    assert error.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting_requests" in error.value.details()
    for call in calls:
        call.cancel()
    assert_idle(stack)


def _wait_for(stack, condition) -> None:
    deadline = time.monotonic() + 10
    while not condition(stack.load()):
        assert time.monotonic() < deadline, stack.load()
        time.sleep(0.02)


def _auth(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_only_the_owner_or_an_admin_aborts_a_request(stack, generation):
    call = generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
        request_id="alices", token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(**LONG)), timeout=60, metadata=_auth("alice"))
    next(call)
    for metadata in (_auth("bob"), None, _auth("let-me-in-not")):  # another key, none, near miss
        with pytest.raises(grpc.RpcError) as error:
            generation.Abort(gateway_pb2.AbortRequest(request_id="alices"), timeout=10,
                             metadata=metadata)
        assert error.value.code() == grpc.StatusCode.NOT_FOUND
        assert error.value.details().endswith("request_id 'alices' is not running")
    next(call)  # still generating
    generation.Abort(gateway_pb2.AbortRequest(request_id="alices"), timeout=10,
                     metadata=_auth(ADMIN_TOKEN))
    assert list(call)[-1].finish_reason == ABORT
    assert_idle(stack)


def test_the_owner_aborts_its_own_request(stack, generation):
    call = generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
        request_id="mine", token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(**LONG)), timeout=60, metadata=_auth("carol"))
    next(call)
    generation.Abort(gateway_pb2.AbortRequest(request_id="mine"), timeout=10,
                     metadata=_auth("carol"))
    assert list(call)[-1].finish_reason == ABORT
    assert_idle(stack)


@pytest.mark.parametrize("epoch", ["huge", "next", "previous"])
def test_a_foreign_clear_state_is_refused_while_the_stack_serves(stack, generation, epoch):
    """The worker port reached by someone who is not its scheduler: ClearState with any epoch
    but the scheduler's is refused, the refusal does not name the worker's epoch, and a stream
    running meanwhile ends normally."""
    own = stack.scheduler[1].engine.core.scheduler_epoch
    value = {"huge": (1 << 64) - 1, "next": own + 1, "previous": own - 1}[epoch]
    call = generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        timeout=60)
    first = next(call)
    with grpc.insecure_channel(stack.worker_address) as channel:
        with pytest.raises(grpc.RpcError) as error:
            worker_pb2_grpc.WorkerServiceStub(channel).ClearState(
                worker_pb2.ClearStateRequest(scheduler_epoch=value), timeout=10)
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert str(own) not in error.value.details()
    responses = list(call)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in [first, *responses]) == 40
    assert_idle(stack)
