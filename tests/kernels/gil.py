"""Whether a native call lets go of the GIL: another thread's Python runs while it is inside."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

MARGIN_S = 0.002  # far past the switch interval set below: a reading there is inside the call


def python_runs_during(call: Callable[[], object], num_calls: int = 10) -> bool:
    """Runs `call` num_calls times on a thread while this one reads the clock in a loop; True if
    a reading falls inside a call, MARGIN_S from both its ends. With the GIL held for the whole
    call, the readings stop at its start (the thread may be switched out just before it) and go
    on after its end."""
    spans: list[tuple[float, float]] = []
    current: list[float | None] = [None]  # the call's start while one runs
    done = threading.Event()

    def run() -> None:
        for _ in range(num_calls):
            current[0] = start = time.perf_counter()
            call()
            end = time.perf_counter()
            current[0] = None
            spans.append((start, end))
        done.set()

    readings: list[float] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    try:
        thread = threading.Thread(target=run)
        thread.start()
        while not done.is_set():
            start, now = current[0], time.perf_counter()
            if start is not None and now > start + MARGIN_S and len(readings) < 10_000:
                readings.append(now)
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    return any(start + MARGIN_S < t < end - MARGIN_S for start, end in spans for t in readings)
