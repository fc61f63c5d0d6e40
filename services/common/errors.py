"""The error taxonomy shared by every core, mapped to gRPC status codes in services/rpc/status.py
only: cores raise these and never import grpc."""


class PagedServeError(Exception):
    """Base of every error the services turn into a status code."""


class InvalidRequest(PagedServeError, ValueError):
    """Bad user input (→ INVALID_ARGUMENT). The message names the field and the value."""


class ConfigError(InvalidRequest):
    """A configuration value is out of range; the message quotes it."""


class Overloaded(PagedServeError):
    """Too much work already accepted (→ RESOURCE_EXHAUSTED)."""


class NotFound(PagedServeError, KeyError):
    """Unknown request id or resource (→ NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message plain
        return str(self.args[0]) if self.args else ""


class Unavailable(PagedServeError):
    """A peer is gone or the service is draining (→ UNAVAILABLE)."""


class StaleEpoch(PagedServeError):
    """Another scheduler's epoch (→ FAILED_PRECONDITION)."""


class StepOutOfOrder(StaleEpoch):
    """The step's predecessor did not run, or failed: as with a stale epoch, the worker's state
    is not what the scheduler thinks, and ClearState resyncs it."""
