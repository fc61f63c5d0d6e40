"""How soon a full queue frees a place: the Retry-After of QUEUE_FULL and RATE_LIMITED.

A place frees when a request finishes, so the wait for `num_places` is that many of the mean
intervals between the last completions. Before two completions there is no rate to go by, and
the wait is DEFAULT_RETRY_AFTER_S.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from pagedserve.services.common.errors import DEFAULT_RETRY_AFTER_S

MAX_RETRY_AFTER_S = 60.0  # a stalled engine must not tell clients to come back in an hour


class DrainRate:
    def __init__(self, window: int = 16, clock: Callable[[], float] = time.monotonic) -> None:
        self._times: deque[float] = deque(maxlen=window)
        self._clock = clock

    def record(self) -> None:
        """A request finished."""
        self._times.append(self._clock())

    def wait_s(self, num_places: int = 1) -> float:
        if len(self._times) < 2:
            return DEFAULT_RETRY_AFTER_S
        interval_s = (self._times[-1] - self._times[0]) / (len(self._times) - 1)
        return min(MAX_RETRY_AFTER_S, max(1, num_places) * interval_s)
