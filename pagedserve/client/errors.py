"""What a failed call tells a client: the status code and message, and the google.rpc.Status
details the gateway attaches (ErrorInfo's reason, BadRequest's field violations, RetryInfo's
delay). Details a server did not send are None or empty."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str  # the request field's path, e.g. "sampling.temperature"
    description: str


class ClientError(Exception):
    """A call that failed: `code` (grpc.StatusCode), `message`, and the rich details;
    `num_attempts` counts the retries too."""

    def __init__(self, code: grpc.StatusCode, message: str, *, reason: str | None = None,
                 domain: str | None = None, metadata: dict[str, str] | None = None,
                 field_violations: tuple[FieldViolation, ...] = (),
                 retry_delay_s: float | None = None, num_attempts: int = 1) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.reason = reason
        self.domain = domain
        self.metadata = metadata or {}
        self.field_violations = field_violations
        self.retry_delay_s = retry_delay_s
        self.num_attempts = num_attempts


def _status_details(call: grpc.Call) -> list:
    try:
        status = rpc_status.from_call(call)
    except ValueError:  # the details' code disagrees with the call's: trust neither
        return []
    return [] if status is None else list(status.details)


def client_error(error: grpc.RpcError, num_attempts: int = 1) -> ClientError:
    """From a failed call, sync (grpc.RpcError that is a grpc.Call) or asyncio (AioRpcError)."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (error.details() if callable(getattr(error, "details", None)) else None) or ""
    kw: dict = {}
    for detail in _status_details(error) if hasattr(error, "trailing_metadata") else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            kw.update(reason=info.reason, domain=info.domain, metadata=dict(info.metadata))
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            kw["field_violations"] = tuple(FieldViolation(v.field, v.description)
                                           for v in bad.field_violations)
        elif detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
            retry = error_details_pb2.RetryInfo()
            detail.Unpack(retry)
            kw["retry_delay_s"] = retry.retry_delay.ToTimedelta().total_seconds()
    return ClientError(code, message, num_attempts=num_attempts, **kw)
