"""The error taxonomy shared by every core. Mapping to gRPC status codes lives in one place,
`services.status`; cores raise these and never import grpc."""


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
    """A call with a scheduler epoch other than the one of the scheduler the worker serves
    (→ FAILED_PRECONDITION)."""


class StepOutOfOrder(StaleEpoch):
    """A step whose predecessor (previous_step_id) did not run, or failed, on this worker: like a
    stale epoch, the worker's state is not what the scheduler thinks, and ClearState resyncs it
    (→ FAILED_PRECONDITION)."""
