import asyncio
import contextlib

import grpc
import pytest
from pagedserve.services.common.drain_rate import MAX_RETRY_AFTER_S, DrainRate
from pagedserve.services.common.errors import (
    DEFAULT_RETRY_AFTER_S,
    DOMAIN,
    ConfigError,
    FieldViolation,
    InvalidRequest,
    NotFound,
    Overloaded,
    PagedServeError,
    Reason,
    StaleEpoch,
    Unavailable,
)
from pagedserve.services.rpc.server import ServiceBinding, create_server
from pagedserve.services.rpc.status import (
    ErrorDetails,
    details_of,
    error_details,
    error_from_rpc,
    error_from_status,
    map_errors,
    parse_status,
    rich_status,
    status_of,
)
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


@contextlib.asynccontextmanager
async def failing_generation():
    """A FailingGeneration server on a free port, and a stub that calls it."""
    server, port = create_server([ServiceBinding(
        FailingGeneration(), gateway_pb2_grpc.add_GenerationServiceServicer_to_server,
        "pagedserve.v1.GenerationService")], port=0)
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield gateway_pb2_grpc.GenerationServiceStub(channel)
    finally:
        await server.shutdown(grace_s=0)


@pytest.mark.parametrize("exc, code", CASES)
def test_servicer_errors_reach_the_client_with_their_code(exc, code):
    async def main():
        async with failing_generation() as stub:
            name = type(exc).__name__
            with pytest.raises(grpc.aio.AioRpcError) as unary:
                await stub.Tokenize(gateway_pb2.TokenizeRequest(text=name), timeout=5)
            call = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(text=name), timeout=5)
            first = await call.read()
            with pytest.raises(grpc.aio.AioRpcError) as streaming:
                await call.read()
        return first, unary.value, streaming.value

    first, unary, streaming = asyncio.run(main())
    assert first.text == "first"
    for err in (unary, streaming):
        assert err.code() == code
        assert str(exc) in err.details()
        if code != grpc.StatusCode.INTERNAL:
            assert type(error_from_rpc(err)) is type(exc) or isinstance(exc, ConfigError)


def test_rich_status_round_trips_every_detail():
    """What a scheduler sends is what the gateway forwards: reason, fields, metadata, retry."""
    sent = Overloaded("3 requests are waiting", reason=Reason.QUEUE_FULL, retry_after_s=1.25,
                      metadata={"limit": "3"})
    status = rich_status(sent)
    details = parse_status(status)
    assert (details.reason, details.domain, details.retry_after_s) == ("QUEUE_FULL", DOMAIN, 1.25)
    back = error_from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, status.message, "scheduler",
                             details)
    assert isinstance(back, Overloaded) and str(back) == str(sent)
    assert (back.reason, back.retry_after_s, back.metadata) == (Reason.QUEUE_FULL, 1.25,
                                                                {"limit": "3"})

    bad = InvalidRequest("temperature must be >= 0, got -1.0", reason=Reason.INVALID_SAMPLING_PARAMS,
                         violations=[FieldViolation("temperature", "t"),
                                     FieldViolation("top_p", "p")]).nested("sampling")
    details = parse_status(rich_status(bad))
    assert [v.field for v in details.violations] == ["sampling.temperature", "sampling.top_p"]
    assert details.metadata["field"] == "sampling.temperature"
    assert details.retry_after_s is None  # INVALID_ARGUMENT: retrying as is cannot help
    back = error_from_status(grpc.StatusCode.INVALID_ARGUMENT, str(bad), rich=details)
    assert back.violations == bad.violations and back.reason == Reason.INVALID_SAMPLING_PARAMS


def test_details_without_a_known_reason_keep_the_type_default():
    assert details_of(ZeroDivisionError("x")).reason == Reason.INTERNAL
    assert Unavailable("gone").retry_after_s == DEFAULT_RETRY_AFTER_S
    unknown = ErrorDetails(reason="FROM_A_NEWER_VERSION", domain=DOMAIN)
    assert error_from_status(grpc.StatusCode.NOT_FOUND, "x", rich=unknown).reason == \
        Reason.NOT_FOUND


def test_error_details_reads_the_trailers_of_a_failed_call():
    async def main():
        async with failing_generation() as stub:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Tokenize(gateway_pb2.TokenizeRequest(text="Unavailable"), timeout=5)
        return err.value

    err = asyncio.run(main())
    details = error_details(err)
    assert details.reason == Reason.PEER_UNAVAILABLE
    assert details.retry_after_s == DEFAULT_RETRY_AFTER_S
    assert error_from_rpc(err).retry_after_s == DEFAULT_RETRY_AFTER_S


def test_drain_rate_waits_the_mean_interval_between_completions_per_place():
    times = iter([10.0, 10.2, 10.4, 10.6])
    rate = DrainRate(clock=lambda: next(times))
    assert rate.wait_s() == DEFAULT_RETRY_AFTER_S  # nothing finished yet: nothing to go by
    for _ in range(4):
        rate.record()
    assert rate.wait_s() == pytest.approx(0.2)
    assert rate.wait_s(3) == pytest.approx(0.6)
    stalled = DrainRate(clock=iter([0.0, 1000.0]).__next__)
    stalled.record()
    stalled.record()
    assert stalled.wait_s() == MAX_RETRY_AFTER_S
