"""What a failed call tells a client: the status code and message, and the google.rpc.Status
details the gateway attaches (ErrorInfo's reason, BadRequest's field violations, RetryInfo's
delay), read by the same code the services use. Details a server did not send are None or
empty."""

from __future__ import annotations

import grpc

from pagedserve.services.common.errors import FieldViolation
from pagedserve.services.rpc.status import error_details

__all__ = ["ClientError", "FieldViolation", "client_error"]


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


def client_error(error: grpc.RpcError, num_attempts: int = 1) -> ClientError:
    """From a failed call, sync (grpc.RpcError that is a grpc.Call) or asyncio (AioRpcError)."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (error.details() if callable(getattr(error, "details", None)) else None) or ""
    details = error_details(error) if hasattr(error, "trailing_metadata") else None
    if details is None:
        return ClientError(code, message, num_attempts=num_attempts)
    return ClientError(code, message, reason=details.reason or None,
                       domain=details.domain or None, metadata=dict(details.metadata),
                       field_violations=details.violations,
                       retry_delay_s=details.retry_after_s, num_attempts=num_attempts)
