"""The one thread that runs a worker's model calls, in submission order: the model and its KV
cache are not thread-safe. A step may be launched before the one in flight is finished
(worker_svc/launch_window.py: the rules); any other call finishes the step in flight first, and
so does an idle queue once the device is done. A thread that dies (its initializer raised) fails
every call queued and every call after, so no caller waits for it forever.

The thread is a daemon, so an engine nobody closed cannot keep the interpreter alive; but a
daemon thread still inside torch once the interpreter finalizes aborts the process ("terminate
called without an active exception"). That happens when the worker is collected on this very
thread (its finalizer cannot join the thread it runs on) and exit comes while it is torn down.
So at exit every model thread still alive is told to stop and joined first.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.services.common.step_plan import StepOutput, StepPlan

if TYPE_CHECKING:
    from pagedserve.worker_svc.launch_window import LaunchWindow
    from pagedserve.worker_svc.worker import Worker

logger = logging.getLogger(__name__)

EXIT_JOIN_TIMEOUT_S = 60.0  # a thread stuck longer than this at exit is left to its fate


@dataclass(slots=True)
class _Job:
    future: Future = field(default_factory=Future)
    call: Callable[[], Any] | None = None
    worker: Worker | None = None  # a step's
    plan: StepPlan | None = None
    then: Callable[[StepOutput], Any] | None = None  # a step's output → the future's result


class ModelThread:
    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._initializer = initializer
        self._error: BaseException | None = None  # why the thread died
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        _live.add(self)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        job = _Job(call=lambda: fn(*args))
        self._put(job)
        return job.future

    def submit_step(self, worker: Worker, plan: StepPlan,
                    then: Callable[[StepOutput], Any] | None = None) -> Future:
        """The future's result is the step's output, or then(output), run on this thread."""
        job = _Job(worker=worker, plan=plan, then=then)
        self._put(job)
        return job.future

    def shutdown(self, wait: bool = False) -> None:
        """Finishes what was submitted, then the thread ends; `wait`: returns once it has, unless
        called on that very thread."""
        self._jobs.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _join_at_exit(self) -> None:
        self._jobs.put(None)
        self._thread.join(EXIT_JOIN_TIMEOUT_S)
        if self._thread.is_alive():
            logger.warning("model thread %s still busy after %.0f s at exit",
                           self._thread.name, EXIT_JOIN_TIMEOUT_S)

    def _put(self, job: _Job) -> None:
        self._jobs.put(job)
        if self._error is not None:  # after the thread's last look at the queue, or before it
            self._fail_queued()

    def _fail_queued(self) -> None:
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError(
                    f"model thread {self._thread.name} died: {self._error!r}"))

    def _loop(self) -> None:
        try:
            self._serve()
        except BaseException as e:
            logger.exception("model thread %s died", self._thread.name)
            self._error = e
            self._fail_queued()

    def _serve(self) -> None:
        initializer, self._initializer = self._initializer, None
        if initializer is not None:
            initializer()
        busy: LaunchWindow | None = None  # the window with a step in flight
        while True:
            # While it waits, the thread holds no job: a worker nothing else holds can be
            # collected, and its finalizer then ends this thread.
            job = None
            try:
                wait_s = None if busy is None else busy.seconds_left()
                job = self._jobs.get(timeout=wait_s) if wait_s != 0 else self._jobs.get_nowait()
            except queue.Empty:
                busy.finish()
                busy = None
                continue
            if busy is not None and (job is None or job.plan is None
                                     or job.worker.steps is not busy):
                busy.finish()
                busy = None
            if job is None:
                logger.debug("model thread %s stopped", self._thread.name)
                return
            if job.plan is None:
                self._run(job)
                continue
            busy = job.worker.steps
            busy.launch(job.worker, job.plan, job.future, job.then)
            if not busy.has_step_in_flight:
                busy = None

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.call())
        except BaseException as e:
            job.future.set_exception(e)


_live: weakref.WeakSet[ModelThread] = weakref.WeakSet()  # a running thread holds its own


@atexit.register
def _join_live_threads() -> None:
    for thread in list(_live):
        thread._join_at_exit()
