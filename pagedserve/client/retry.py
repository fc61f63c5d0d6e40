"""When to call again: UNAVAILABLE and RESOURCE_EXHAUSTED are retried, after the server's
RetryInfo delay when it sent one, else after an exponential backoff with jitter; never past the
call's deadline nor more than max_attempts times. A stream that already returned output is
never retried (its caller has seen tokens a new call would repeat)."""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass

import grpc

from pagedserve.client.errors import ClientError
from pagedserve.services.common.errors import InvalidRequest

logger = logging.getLogger(__name__)

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4  # 1 = never retry
    initial_backoff_s: float = 0.2
    max_backoff_s: float = 5.0
    backoff_multiplier: float = 2.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InvalidRequest(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise InvalidRequest(f"need 0 <= initial_backoff_s <= max_backoff_s, got "
                                 f"{self.initial_backoff_s} and {self.max_backoff_s}")
        if self.backoff_multiplier < 1:
            raise InvalidRequest(
                f"backoff_multiplier must be >= 1, got {self.backoff_multiplier}")

    def backoff_s(self, num_attempts: int) -> float:
        """After the num_attempts-th failure, with ±20% jitter so clients spread out."""
        base = self.initial_backoff_s * self.backoff_multiplier ** (num_attempts - 1)
        return min(self.max_backoff_s, base) * random.uniform(0.8, 1.2)


DEFAULT_RETRY = RetryPolicy()


class Deadline:
    """One deadline over every attempt of a call (None = no deadline)."""

    __slots__ = ("_end",)

    def __init__(self, timeout_s: float | None) -> None:
        self._end = None if timeout_s is None else time.monotonic() + timeout_s

    def remaining_s(self) -> float | None:
        return None if self._end is None else max(0.0, self._end - time.monotonic())


def retry_delay_s(policy: RetryPolicy | None, error: ClientError, deadline: Deadline,
                  method: str) -> float | None:
    """How long to wait before the next attempt, or None to give up and raise `error`."""
    if (policy is None or error.code not in RETRYABLE_CODES
            or error.num_attempts >= policy.max_attempts):
        return None
    delay_s = (error.retry_delay_s if error.retry_delay_s is not None
               else policy.backoff_s(error.num_attempts))
    remaining_s = deadline.remaining_s()
    if remaining_s is not None and delay_s >= remaining_s:
        return None
    logger.info("%s failed with %s; retrying in %.3fs (attempt %d of %d)", method, error,
                delay_s, error.num_attempts + 1, policy.max_attempts)
    return delay_s
