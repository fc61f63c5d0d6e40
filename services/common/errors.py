"""The error taxonomy shared by every core, mapped to gRPC status codes in services/rpc/status.py
only: cores raise these and never import grpc.

Besides its message, an error carries what a client acts on without parsing text, as plain data:
a stable `reason`, the request fields it is about (`violations`, paths in the caller's request:
`sampling.temperature`, `token_ids[3]`), `metadata` (value, limit), and `retry_after_s` when
waiting and retrying can succeed. Each front door turns these into its wire form (google.rpc
details, OpenAI's error body) and field paths into its own request's paths."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Self

DOMAIN = "pagedserve"  # google.rpc.ErrorInfo.domain of every reason below
# gRPC's initial reconnect backoff: a peer that just went away is worth trying again after this
DEFAULT_RETRY_AFTER_S = 1.0


class Reason(StrEnum):
    """Stable machine-readable reasons (google.rpc.ErrorInfo.reason, OpenAI's error `code`)."""

    # INVALID_ARGUMENT
    MALFORMED_REQUEST = "MALFORMED_REQUEST"  # not a valid protobuf message
    PROMPT_MISSING = "PROMPT_MISSING"
    PROMPT_EMPTY = "PROMPT_EMPTY"
    INVALID_PROMPT = "INVALID_PROMPT"
    PROMPT_TOO_LONG = "PROMPT_TOO_LONG"
    MAX_TOKENS_TOO_LARGE = "MAX_TOKENS_TOO_LARGE"
    KV_CACHE_TOO_SMALL = "KV_CACHE_TOO_SMALL"
    UNKNOWN_TOKEN_ID = "UNKNOWN_TOKEN_ID"
    NO_CHAT_TEMPLATE = "NO_CHAT_TEMPLATE"
    INVALID_CHAT_MESSAGE = "INVALID_CHAT_MESSAGE"
    INVALID_SAMPLING_PARAMS = "INVALID_SAMPLING_PARAMS"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    INVALID_REQUEST_ID = "INVALID_REQUEST_ID"
    REQUEST_ID_IN_USE = "REQUEST_ID_IN_USE"
    INVALID_PRIORITY = "INVALID_PRIORITY"
    UNSUPPORTED_PARAMETER = "UNSUPPORTED_PARAMETER"
    INVALID_BODY = "INVALID_BODY"
    INVALID_REQUEST = "INVALID_REQUEST"  # internal services' own checks
    INVALID_CONFIG = "INVALID_CONFIG"
    # RESOURCE_EXHAUSTED
    QUEUE_FULL = "QUEUE_FULL"
    RATE_LIMITED = "RATE_LIMITED"
    STREAM_STALLED = "STREAM_STALLED"
    # UNAUTHENTICATED
    UNAUTHENTICATED = "UNAUTHENTICATED"
    # PERMISSION_DENIED (an internal peer whose certificate's role may not call the method)
    PERMISSION_DENIED = "PERMISSION_DENIED"
    # NOT_FOUND
    REQUEST_NOT_FOUND = "REQUEST_NOT_FOUND"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    NOT_FOUND = "NOT_FOUND"
    # UNAVAILABLE
    GATEWAY_DRAINING = "GATEWAY_DRAINING"
    SCHEDULER_UNAVAILABLE = "SCHEDULER_UNAVAILABLE"
    SCHEDULER_DRAINING = "SCHEDULER_DRAINING"
    SCHEDULER_STARTING = "SCHEDULER_STARTING"
    PEER_UNAVAILABLE = "PEER_UNAVAILABLE"
    # FAILED_PRECONDITION (between internal services)
    STALE_EPOCH = "STALE_EPOCH"
    # INTERNAL
    GENERATION_FAILED = "GENERATION_FAILED"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True, slots=True)
class FieldViolation:
    field: str  # a path in the request: "sampling.stop[1]", "messages[0].role"
    description: str


class PagedServeError(Exception):
    """Base of every error the services turn into a status code. `field`: shorthand for one
    violation described by the message."""

    default_reason = Reason.INTERNAL
    default_retry_after_s: float | None = None

    def __init__(self, message: str = "", *, reason: Reason | None = None, field: str = "",
                 violations: Sequence[FieldViolation] = (),
                 metadata: Mapping[str, str] | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason or self.default_reason
        self.violations = tuple(violations) or ((FieldViolation(field, message),) if field else ())
        self.metadata = dict(metadata or {})
        self.retry_after_s = self.default_retry_after_s if retry_after_s is None else retry_after_s

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""

    def with_fields(self, path_of: Callable[[str], str]) -> Self:
        """A copy whose violations name their fields by `path_of(field)`: a front door's own
        request paths, or a nested message's (`nested`)."""
        error = copy.copy(self)
        error.violations = tuple(FieldViolation(path_of(v.field), v.description)
                                 for v in self.violations)
        error.__cause__ = self.__cause__
        return error

    def nested(self, prefix: str) -> Self:
        """Fields of a message that sits at `prefix` in the request: `temperature` of the
        request's `sampling` is `sampling.temperature`."""
        return self.with_fields(lambda f: f"{prefix}{f}" if f.startswith("[")
                                else f"{prefix}.{f}")


class InvalidRequest(PagedServeError, ValueError):
    """Bad user input (→ INVALID_ARGUMENT). The message names the field and the value."""

    default_reason = Reason.INVALID_REQUEST


class ConfigError(InvalidRequest):
    """A configuration value is out of range; the message quotes it."""

    default_reason = Reason.INVALID_CONFIG


class Overloaded(PagedServeError):
    """Too much work already accepted (→ RESOURCE_EXHAUSTED)."""

    default_reason = Reason.QUEUE_FULL


class NotFound(PagedServeError, KeyError):
    """Unknown request id or resource (→ NOT_FOUND)."""

    default_reason = Reason.NOT_FOUND

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain
        return str(self.args[0]) if self.args else ""


class Unavailable(PagedServeError):
    """A peer is gone or the service is draining (→ UNAVAILABLE)."""

    default_reason = Reason.PEER_UNAVAILABLE
    default_retry_after_s = DEFAULT_RETRY_AFTER_S


class StaleEpoch(PagedServeError):
    """Another scheduler's epoch (→ FAILED_PRECONDITION)."""

    default_reason = Reason.STALE_EPOCH


class StepOutOfOrder(StaleEpoch):
    """The step's predecessor did not run, or failed: as with a stale epoch, the worker's state
    is not what the scheduler thinks, and ClearState resyncs it."""
