"""Rich errors from the real scheduler, through the real gateway, on the tiny stack: a full queue
is RESOURCE_EXHAUSTED with QUEUE_FULL and RetryInfo (gRPC) or 429 with the same code and a
Retry-After header (HTTP); a request id already running is refused naming `request_id`."""

import dataclasses
import time

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from pagedserve.services.common.config import SchedulerConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle

LONG = common_pb2.SamplingParams(max_tokens=480, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def stack_config(stack_config):
    """One sequence runs at a time and one request may wait."""
    return dataclasses.replace(stack_config,
                               scheduler=SchedulerConfig(max_num_seqs=1, max_waiting_requests=1))


def details(err: grpc.RpcError) -> dict:
    status = rpc_status.from_call(err)
    found = {}
    for kind in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest,
                 error_details_pb2.RetryInfo):
        for detail in status.details:
            if detail.Is(kind.DESCRIPTOR):
                found[kind.__name__] = kind()
                detail.Unpack(found[kind.__name__])
    return found


def wait_for(stack, num_running: int, num_waiting: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        load = stack.load()
        if (load.num_running_requests, load.num_waiting_requests) == (num_running, num_waiting):
            return
        assert time.monotonic() < deadline, f"never {num_running} running, {num_waiting} waiting"
        time.sleep(0.01)


def test_a_full_queue_says_queue_full_and_when_to_retry(stack):
    with grpc.insecure_channel(stack.gateway_address) as channel:
        generation = gateway_pb2_grpc.GenerationServiceStub(channel)
        running = generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
            request_id="running", text="the quick brown fox", sampling=LONG), timeout=60)
        next(running)
        waiting = generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
            request_id="waiting", text="hello", sampling=LONG), timeout=60)
        wait_for(stack, num_running=1, num_waiting=1)
        with pytest.raises(grpc.RpcError) as full:
            generation.Generate(gateway_pb2.GenerateRequest(text="hello"), timeout=30)
        response = httpx.post(f"{stack.http_url}/v1/completions",
                              json={"prompt": "hello", "max_tokens": 2}, timeout=30)
        waiting.cancel()
        wait_for(stack, num_running=1, num_waiting=0)
        with pytest.raises(grpc.RpcError) as duplicate:
            next(generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
                request_id="running", text="hello"), timeout=30))
        running.cancel()
    assert full.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting_requests" in full.value.details()  # the message stays
    found = details(full.value)
    assert found["ErrorInfo"].reason == "QUEUE_FULL"
    assert found["ErrorInfo"].domain == "pagedserve"
    assert found["ErrorInfo"].metadata["limit"] == "1"
    assert found["RetryInfo"].retry_delay.ToNanoseconds() > 0

    assert duplicate.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    found = details(duplicate.value)
    assert found["ErrorInfo"].reason == "REQUEST_ID_IN_USE"
    assert [v.field for v in found["BadRequest"].field_violations] == ["request_id"]

    assert response.status_code == 429
    assert response.json()["error"]["code"] == "QUEUE_FULL"
    assert int(response.headers["Retry-After"]) >= 1
    assert_idle(stack, timeout_s=10)
