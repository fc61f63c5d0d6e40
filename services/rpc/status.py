"""The one mapping between the error taxonomy (pagedserve.services.common.errors) and gRPC status codes.

Servicers: decorate handlers with `@map_errors` (unary and server-streaming alike), or call
`abort_with(context, exc)`. Clients: turn a failed call into our errors with `error_from_rpc`.
Unexpected exceptions become INTERNAL with their message (and a logged traceback); a bad request
never takes the service down.
"""

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

# Most specific first: ConfigError is an InvalidRequest, NotFound is also a KeyError.
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
# A peer that did not answer in time, or that dropped the call, is as good as gone.
_PEER_GONE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
              grpc.StatusCode.CANCELLED)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """(code, message) for an exception; anything outside the taxonomy is INTERNAL."""
    for error_type, code in _TO_CODE:
        if isinstance(exc, error_type):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status `exc` maps to. Raises (grpc's abort always does)."""
    code, message = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.error("unexpected error in handler", exc_info=exc)
    await context.abort(code, message)
    raise AssertionError("context.abort returned")  # grpc.aio's abort never returns


Handler = TypeVar("Handler", bound=Callable[..., Any])


def map_errors(handler: Handler) -> Handler:
    """Decorate a grpc.aio handler `(self, request, context)`, unary (coroutine) or
    server-streaming (async generator): an exception becomes its status code."""
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
    """Our error for a status a peer answered with; codes outside the taxonomy (INTERNAL,
    UNKNOWN, ...) become a plain PagedServeError, which maps back to INTERNAL."""
    if code in _PEER_GONE:
        return Unavailable(f"{peer} is unavailable ({code.name}): {details}")
    error_type = _FROM_CODE.get(code)
    if error_type is None:
        return PagedServeError(f"{peer} failed with {code.name}: {details}")
    return error_type(details)


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str = "peer") -> PagedServeError:
    """A failed client call as our error (raise it `from exc`)."""
    return error_from_status(exc.code(), exc.details() or "", peer)
