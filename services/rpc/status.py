"""The one mapping between the error taxonomy (services/common/errors.py) and gRPC status codes,
with google.rpc.Status details (grpcio-status) built from what the error carries: ErrorInfo
(reason, domain "pagedserve", metadata) always, BadRequest (one field violation per bad field) on
INVALID_ARGUMENT, RetryInfo where waiting helps (RESOURCE_EXHAUSTED, UNAVAILABLE). Clients read
them back with `error_details`; a service that forwards a peer's error keeps them
(`error_from_rpc`). Unexpected exceptions become INTERNAL with their message and a logged
traceback."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status
from pagedserve.services.common.errors import (
    DOMAIN,
    FieldViolation,
    InvalidRequest,
    NotFound,
    Overloaded,
    PagedServeError,
    Reason,
    StaleEpoch,
    Unavailable,
)

logger = logging.getLogger(__name__)

DETAILS_KEY = "grpc-status-details-bin"
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


_RETRIED_CODES = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


@dataclass(frozen=True, slots=True)
class ErrorDetails:
    """What a google.rpc.Status carries besides code and message."""

    reason: str = ""
    domain: str = ""
    metadata: Mapping[str, str] = field(default_factory=dict)
    violations: tuple[FieldViolation, ...] = ()
    retry_after_s: float | None = None


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    for error_type, code in _TO_CODE:
        if isinstance(exc, error_type):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def details_of(exc: BaseException) -> ErrorDetails:
    if not isinstance(exc, PagedServeError):
        return ErrorDetails(Reason.INTERNAL, DOMAIN)
    metadata = dict(exc.metadata)
    if exc.violations:
        metadata.setdefault("field", exc.violations[0].field)
    retried = status_of(exc)[0] in _RETRIED_CODES
    return ErrorDetails(exc.reason, DOMAIN, metadata, exc.violations,
                        exc.retry_after_s if retried else None)


def status_with_reason(code: grpc.StatusCode, message: str, reason: Reason,
                       metadata: Mapping[str, str] | None = None) -> status_pb2.Status:
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(error_details_pb2.ErrorInfo(reason=reason, domain=DOMAIN,
                                                          metadata=metadata))
    return status


def rich_status(exc: BaseException) -> status_pb2.Status:
    """The google.rpc.Status a handler ends with for `exc`: code, message, details."""
    code, message = status_of(exc)
    details = details_of(exc)
    status = status_with_reason(code, message, Reason(details.reason), details.metadata)
    if details.violations and code == grpc.StatusCode.INVALID_ARGUMENT:
        status.details.add().Pack(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in details.violations]))
    if details.retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(round(details.retry_after_s * 1e9))
        status.details.add().Pack(error_details_pb2.RetryInfo(retry_delay=delay))
    return status


def grpc_status_of(exc: BaseException) -> grpc.Status:
    """For `context.abort_with_status`."""
    return rpc_status.to_status(rich_status(exc))


def parse_status(status: status_pb2.Status) -> ErrorDetails:
    """The details of a google.rpc.Status (those it lacks stay empty)."""
    reason, domain, metadata = "", "", {}
    violations: tuple[FieldViolation, ...] = ()
    retry_after_s = None
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason, domain, metadata = info.reason, info.domain, dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad_request = error_details_pb2.BadRequest()
            detail.Unpack(bad_request)
            violations = tuple(FieldViolation(v.field, v.description)
                               for v in bad_request.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            retry_after_s = retry.retry_delay.ToNanoseconds() / 1e9
    return ErrorDetails(reason, domain, metadata, violations, retry_after_s)


def error_details(call: grpc.Call | grpc.aio.AioRpcError) -> ErrorDetails | None:
    """The details of a failed call (a sync grpc.RpcError or a grpc.aio.AioRpcError); None when
    the server sent none."""
    for key, value in call.trailing_metadata() or ():
        if key == DETAILS_KEY:
            return parse_status(status_pb2.Status.FromString(value))
    return None


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException,
                     field_path: Callable[[str], str] | None = None) -> NoReturn:
    """`field_path`: the handler's request paths for the error's fields."""
    if field_path is not None and isinstance(exc, PagedServeError):
        exc = exc.with_fields(field_path)
    status = grpc_status_of(exc)
    if status.code == grpc.StatusCode.INTERNAL and details_of(exc).reason == Reason.INTERNAL:
        logger.error("unexpected error in handler", exc_info=exc)
    await context.abort_with_status(status)
    raise AssertionError("context.abort returned")  # grpc.aio's abort never returns


Handler = TypeVar("Handler", bound=Callable[..., Any])


def map_errors(handler: Handler | None = None, *,
               field_path: Callable[[str], str] | None = None) -> Any:
    """For unary and server-streaming grpc.aio handlers alike: `@map_errors`, or
    `@map_errors(field_path=...)` to name fields by the request's own paths."""
    if handler is None:
        return functools.partial(map_errors, field_path=field_path)
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
                await abort_with(context, exc, field_path)

        return streaming  # type: ignore[return-value]

    @functools.wraps(handler)
    async def unary(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            return await handler(self, request, context)
        except grpc.aio.AbortError:
            raise
        except Exception as exc:
            await abort_with(context, exc, field_path)

    return unary  # type: ignore[return-value]


def error_from_status(code: grpc.StatusCode, details: str, peer: str = "peer",
                      rich: ErrorDetails | None = None) -> PagedServeError:
    """Codes outside the taxonomy become a plain PagedServeError, which maps back to INTERNAL.
    `rich`: the peer's details, kept (a reason this version does not know falls back to the
    type's own)."""
    rich = rich or ErrorDetails()
    kwargs: dict[str, Any] = {"violations": rich.violations, "metadata": rich.metadata,
                              "retry_after_s": rich.retry_after_s}
    if rich.reason in Reason.__members__:
        kwargs["reason"] = Reason(rich.reason)
    if code in _PEER_GONE:
        if code != grpc.StatusCode.UNAVAILABLE:
            kwargs.pop("reason", None)
        return Unavailable(f"{peer} is unavailable ({code.name}): {details}", **kwargs)
    error_type = _FROM_CODE.get(code)
    if error_type is None:
        return PagedServeError(f"{peer} failed with {code.name}: {details}", **kwargs)
    return error_type(details, **kwargs)


def error_from_rpc(exc: grpc.aio.AioRpcError, peer: str = "peer") -> PagedServeError:
    return error_from_status(exc.code(), exc.details() or "", peer, error_details(exc))
