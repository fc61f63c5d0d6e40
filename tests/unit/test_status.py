import asyncio

import grpc
import pytest
from pagedserve.services.common.errors import (
    ConfigError,
    InvalidRequest,
    NotFound,
    Overloaded,
    PagedServeError,
    StaleEpoch,
    Unavailable,
)
from pagedserve.services.rpc.server import ServiceBinding, create_server
from pagedserve.services.rpc.status import error_from_rpc, error_from_status, map_errors, status_of
from pagedserve.services.rpc.v1 import gateway_pb2, gateway_pb2_grpc

CASES = [
    (InvalidRequest("temperature must be >= 0, got -1.0"), grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError("block_size must be one of 8, 16, got 3"), grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded("1024 requests in flight"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound("request 'x' is unknown"), grpc.StatusCode.NOT_FOUND),
    (Unavailable("scheduler is gone"), grpc.StatusCode.UNAVAILABLE),
    (StaleEpoch("epoch 3 is older than 4"), grpc.StatusCode.FAILED_PRECONDITION),
    (ZeroDivisionError("division by zero"), grpc.StatusCode.INTERNAL),
]


@pytest.mark.parametrize("exc, code", CASES)
def test_status_of(exc, code):
    got_code, message = status_of(exc)
    assert got_code == code
    assert str(exc) in message


@pytest.mark.parametrize("exc, code", CASES[:-1])
def test_round_trip_through_status(exc, code):
    back = error_from_status(code, str(exc))
    assert status_of(back)[0] == code
    assert str(exc) in str(back)


def test_peer_gone_and_unknown_codes():
    assert isinstance(error_from_status(grpc.StatusCode.DEADLINE_EXCEEDED, "slow", "scheduler"),
                      Unavailable)
    internal = error_from_status(grpc.StatusCode.INTERNAL, "boom", "scheduler")
    assert type(internal) is PagedServeError
    assert status_of(internal)[0] == grpc.StatusCode.INTERNAL
    assert "scheduler" in str(internal) and "boom" in str(internal)


class FailingGeneration(gateway_pb2_grpc.GenerationServiceServicer):
    """Raises whatever the request's text names, after one streamed response."""

    errors = {type(e).__name__: e for e, _ in CASES}

    @map_errors
    async def Tokenize(self, request, context):
        raise self.errors[request.text]

    @map_errors
    async def GenerateStream(self, request, context):
        yield gateway_pb2.GenerateStreamResponse(text="first")
        raise self.errors[request.text]


@pytest.mark.parametrize("exc, code", CASES)
def test_servicer_errors_reach_the_client_with_their_code(exc, code):
    async def main():
        server, port = create_server([ServiceBinding(
            FailingGeneration(), gateway_pb2_grpc.add_GenerationServiceServicer_to_server,
            "pagedserve.v1.GenerationService")], port=0)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = gateway_pb2_grpc.GenerationServiceStub(channel)
                name = type(exc).__name__
                with pytest.raises(grpc.aio.AioRpcError) as unary:
                    await stub.Tokenize(gateway_pb2.TokenizeRequest(text=name), timeout=5)
                call = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(text=name), timeout=5)
                first = await call.read()
                with pytest.raises(grpc.aio.AioRpcError) as streaming:
                    await call.read()
        finally:
            await server.shutdown(grace_s=0)
        return first, unary.value, streaming.value

    first, unary, streaming = asyncio.run(main())
    assert first.text == "first"
    for err in (unary, streaming):
        assert err.code() == code
        assert str(exc) in err.details()
        if code != grpc.StatusCode.INTERNAL:
            assert type(error_from_rpc(err)) is type(exc) or isinstance(exc, ConfigError)
