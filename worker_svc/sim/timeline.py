"""The simulated GPU's timeline: work is queued (like kernel launches) and the host waits for it
by sleeping to an absolute deadline, never busy-looping, so the waiting thread leaves the CPU to
the scheduler and the gateway. The wait never ends early; it ends late by the wake-up latency,
kept low by a 1 ns timer slack (Linux's default is 50 us).

Host-link copies run on a lane of their own (the copy engine, a real worker's swap stream): in
issue order, after the queued compute only when asked to, and compute queued after a copy waits
for it.
"""

from __future__ import annotations

import ctypes
import logging
import sys
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_PR_SET_TIMERSLACK = 29
_STATS_EVERY_S = 30.0


def _tighten_timer_slack() -> None:
    """Per thread on Linux; elsewhere sleeps keep the platform's precision."""
    if sys.platform != "linux":
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_TIMERSLACK, 1, 0, 0, 0)
    except (OSError, AttributeError):
        logger.debug("prctl(PR_SET_TIMERSLACK) unavailable; sleeps keep the default slack")


@dataclass(frozen=True, slots=True)
class TimelineStats:
    busy_s: float  # modelled kernel time queued so far
    num_syncs: int


class GpuTimeline:
    def __init__(self, time_scale: float = 1.0) -> None:
        self.time_scale = time_scale
        self._busy_until = 0.0  # perf_counter time at which the queued work is done
        self._copies_until = 0.0  # perf_counter time at which the queued copies are done
        self._queued_s = 0.0  # the queued work's time, idle gaps within it included
        self._busy_s = 0.0  # the part of it spent running kernels
        self._fenced_s = 0.0  # _queued_s at the last fence
        self._num_syncs = 0
        self._local = threading.local()
        self._last_log = (time.perf_counter(), 0.0)

    def enqueue(self, seconds: float, busy_s: float | None = None) -> None:
        """Work that keeps the device `seconds`, of which `busy_s` (default: all) running
        kernels; the rest it waits for the host's launches."""
        seconds *= self.time_scale
        start = max(time.perf_counter(), self._busy_until)
        self._busy_until = start + seconds
        self._queued_s += seconds
        self._busy_s += seconds if busy_s is None else busy_s * self.time_scale

    def enqueue_copy(self, seconds: float, wait_for_compute: bool = True) -> None:
        """A copy over the host link of `seconds`; the compute queued after it waits for it, and
        what compute waits for the copy counts as queued work, not as kernels."""
        seconds *= self.time_scale
        now = time.perf_counter()
        start = max(now, self._copies_until, self._busy_until if wait_for_compute else 0.0)
        self._copies_until = start + seconds
        compute_free_at = max(now, self._busy_until)
        if self._copies_until > compute_free_at:
            self._queued_s += self._copies_until - compute_free_at
            self._busy_until = self._copies_until

    def seconds_queued(self) -> float:
        """Until the work queued so far is done (0: the device is idle)."""
        return max(0.0, self._busy_until - time.perf_counter())

    def synchronize(self) -> None:
        self.wait_until(self._busy_until)

    def fence(self) -> TimelineFence:
        """The work queued so far; its device_s: the time of what was queued since the fence
        before."""
        device_s, self._fenced_s = self._queued_s - self._fenced_s, self._queued_s
        return TimelineFence(self, self._busy_until, device_s)

    def wait_until(self, done_at: float) -> None:
        """Waits for the work queued up to `done_at` (a fence's)."""
        self._sleep_until(done_at)
        self._num_syncs += 1
        self._log_stats()

    def hold_host(self, seconds: float) -> None:
        """The calling thread's own modelled work (launching kernels): it sleeps that long, as
        a host thread busy launching would be unavailable, without using this CPU."""
        if seconds > 0:
            self._sleep_until(time.perf_counter() + seconds * self.time_scale)

    def _sleep_until(self, deadline: float) -> None:
        if not getattr(self._local, "is_slack_set", False):
            _tighten_timer_slack()
            self._local.is_slack_set = True
        while (remaining := deadline - time.perf_counter()) > 0:
            time.sleep(remaining)

    def stats(self) -> TimelineStats:
        return TimelineStats(self._busy_s, self._num_syncs)

    def _log_stats(self) -> None:
        now = time.perf_counter()
        since, busy_then = self._last_log
        if now - since >= _STATS_EVERY_S:
            logger.info("simulated GPU busy %.1f%% of the last %.0f s",
                        100 * (self._busy_s - busy_then) / (now - since), now - since)
            self._last_log = (now, self._busy_s)


@dataclass(frozen=True, slots=True)
class TimelineFence:
    timeline: GpuTimeline
    done_at: float  # perf_counter time
    device_s: float

    def seconds_left(self) -> float:
        return max(0.0, self.done_at - time.perf_counter())

    def wait(self) -> None:
        self.timeline.wait_until(self.done_at)
