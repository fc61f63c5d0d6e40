"""The one mapping between the error taxonomy (services/common/errors.py) and gRPC status codes.
Unexpected exceptions become INTERNAL with their message and a logged traceback."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn, TypeVar

import grpc
from pagedserve.services.common.errors import (
    InvalidRequest,
    NotFound,
    Overloaded,
    PagedServeError,
    StaleEpoch,
    Unavailable,
)

logger = logging.getLogger(__name__)

# most specific first: ConfigError is an InvalidRequest, NotFound is also a KeyError
_TO_CODE: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (InvalidRequest, grpc.StatusCode.INVALID_ARGUMENT),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound, grpc.StatusCode.NOT_FOUND),
    (Unavailable, grpc.StatusCode.UNAVAILABLE),
    (StaleEpoch, grpc.StatusCode.FAILED_PRECONDITION),
)
_FROM_CODE: dict[grpc.StatusCode, type[PagedServeError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.ALREADY_EXISTS: InvalidRequest,  # a request id that is already live
    grpc.StatusCode.OUT_OF_RANGE: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Overloaded,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.FAILED_PRECONDITION: StaleEpoch,
}
# a peer that did not answer in time, or dropped the call, is as good as gone
_PEER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for error_type, code in _TO_CODE:
        if isinstance(exc, error_type):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("unexpected error in handler", exc_info=exc)
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # grpc.aio's abort never returns


Handler = TypeVar("Handler", bound=Callable[..., Any])


def map_errors(handler: Handler) -> Handler:
    """For unary and server-streaming grpc.aio handlers alike."""
    if inspect.isasyncgenfunction(handler):
        @functools.wraps(handler)
        async def streaming(self: Any, request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
            try:
                async for response in handler(self, request, context):
                    yield response
            except grpc.aio.AbortError:
                raise
            except Exception as exc:
                await abort_with(context, exc)

        return streaming  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc)

    return unary  # type: ignore[return-value]


def error_from_status(code: grpc.StatusCode, details: str, peer: str = "peer") -> PagedServeError:
    """Codes outside the taxonomy become a plain PagedServeError, which maps back to INTERNAL."""
    if code in _PEER_GONE:
        return Unavailable(f"{peer} is unavailable ({code.name}): {details}")
    error_type = _FROM_CODE.get(code)
    if error_type is None:
        return PagedServeError(f"{peer} failed with {code.name}: {details}")
    return error_type(details)


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str = "peer") -> PagedServeError:
    return error_from_status(exc.code(), exc.details() or "", peer)
