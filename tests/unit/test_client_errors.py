"""The client's reading of google.rpc.Status details and its retry timing, against a small real
gRPC server that answers with scripted statuses (the gateway's own are in
tests/e2e/test_python_client.py)."""

import asyncio
import time
from concurrent import futures

import grpc
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status
from pagedserve.services.rpc.v1 import gateway_pb2, gateway_pb2_grpc

from pagedserve.client import AsyncClient, Client, ClientError, RetryPolicy

RETRY_DELAY_S = 0.3


def _any(message) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _status(code: int, message: str, *details) -> grpc.Status:
    return rpc_status.to_status(status_pb2.Status(
        code=code, message=message, details=[_any(d) for d in details]))


class ScriptedGeneration(gateway_pb2_grpc.GenerationServiceServicer):
    """Generate: RESOURCE_EXHAUSTED with RetryInfo for the first `num_refusals` calls, then an
    answer. Tokenize: INVALID_ARGUMENT with BadRequest and ErrorInfo."""

    def __init__(self, num_refusals: int) -> None:
        self.num_refusals = num_refusals
        self.call_times: list[float] = []

    def Generate(self, request, context):
        self.call_times.append(time.monotonic())
        if len(self.call_times) <= self.num_refusals:
            context.abort_with_status(_status(
                code_pb2.RESOURCE_EXHAUSTED, "queue full",
                error_details_pb2.ErrorInfo(reason="QUEUE_FULL", domain="pagedserve"),
                error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
                    nanos=int(RETRY_DELAY_S * 1e9)))))
        return gateway_pb2.GenerateResponse(request_id=request.request_id)

    def Tokenize(self, request, context):
        context.abort_with_status(_status(
            code_pb2.INVALID_ARGUMENT, "text must not be empty",
            error_details_pb2.ErrorInfo(reason="EMPTY_PROMPT", domain="pagedserve",
                                        metadata={"field": "text"}),
            error_details_pb2.BadRequest(field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field="text",
                                                            description="must not be empty")])))


@pytest.fixture()
def scripted():
    servicer = ScriptedGeneration(num_refusals=2)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    gateway_pb2_grpc.add_GenerationServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_every_detail_is_read_into_the_client_error(scripted):
    _, address = scripted
    with Client(address, timeout_s=10) as client, pytest.raises(ClientError) as info:
        client.tokenize("")
    error = info.value
    assert (error.code, error.message) == (grpc.StatusCode.INVALID_ARGUMENT,
                                           "text must not be empty")
    assert (error.reason, error.domain, error.metadata) == ("EMPTY_PROMPT", "pagedserve",
                                                            {"field": "text"})
    assert [(v.field, v.description) for v in error.field_violations] == [
        ("text", "must not be empty")]
    assert error.retry_delay_s is None and error.num_attempts == 1


def test_retries_wait_the_servers_retry_delay_not_the_backoff(scripted):
    servicer, address = scripted
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.0, max_backoff_s=0.0)
    with Client(address, timeout_s=10, retry=policy) as client:
        assert client.generate("hi", request_id="r1").request_id == "r1"
    gaps = [b - a for a, b in zip(servicer.call_times, servicer.call_times[1:], strict=False)]
    assert len(gaps) == 2 and all(gap >= RETRY_DELAY_S * 0.95 for gap in gaps)


def test_attempts_are_bounded_and_the_last_error_says_how_many(scripted):
    servicer, address = scripted
    with Client(address, timeout_s=10, retry=RetryPolicy(max_attempts=2)) as client, \
            pytest.raises(ClientError) as info:
        client.generate("hi")
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (info.value.reason, info.value.retry_delay_s) == ("QUEUE_FULL", RETRY_DELAY_S)
    assert info.value.num_attempts == 2 and len(servicer.call_times) == 2


def test_no_retry_whose_delay_would_pass_the_deadline(scripted):
    servicer, address = scripted
    with Client(address, retry=RetryPolicy(max_attempts=5)) as client, \
            pytest.raises(ClientError) as info:
        client.generate("hi", timeout_s=RETRY_DELAY_S / 2)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert len(servicer.call_times) == 1


def test_the_async_client_reads_the_details_and_honours_the_retry_delay(scripted):
    servicer, address = scripted

    async def main():
        async with AsyncClient(address, timeout_s=10) as client:
            with pytest.raises(ClientError) as info:
                await client.tokenize("")
            await client.generate("hi")
            return info.value

    error = asyncio.run(main())
    assert (error.reason, [v.field for v in error.field_violations]) == ("EMPTY_PROMPT", ["text"])
    gaps = [b - a for a, b in zip(servicer.call_times, servicer.call_times[1:], strict=False)]
    assert len(gaps) == 2 and all(gap >= RETRY_DELAY_S * 0.95 for gap in gaps)
