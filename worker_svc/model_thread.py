"""The one thread that runs a worker's model calls, in submission order: the model and its KV
cache are not thread-safe.

Where the device runs apart from the host (CUDA, the simulated GPU), a step that arrives while
the one before is in flight is launched first, and the one before is finished after: the host's
work on step n+1 (its deltas, inputs and launch) overlaps the device's work on step n, and the
device never waits for it. Step n+1's inputs read step n's draws on the device. A step that
cannot go ahead (another call, or a plan that adds tokens after a draw) finishes the one in
flight first; so does an empty queue once the device is done.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pagedserve.services.common.errors import StepOutOfOrder
from pagedserve.services.common.step_plan import StepOutput, StepPlan
from pagedserve.worker_svc.in_flight import InFlightStep

if TYPE_CHECKING:
    from pagedserve.worker_svc.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Job:
    future: Future = field(default_factory=Future)
    call: Callable[[], Any] | None = None
    worker: Worker | None = None  # a step's
    plan: StepPlan | None = None
    then: Callable[[StepOutput], Any] | None = None  # a step's output → the future's result


@dataclass(slots=True)
class _Launched:
    job: _Job
    step: InFlightStep


class ModelThread:
    def __init__(self, name: str, initializer: Callable[[], None] | None = None) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._initializer = initializer
        self.num_launched_ahead = 0
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        job = _Job(call=lambda: fn(*args))
        self._jobs.put(job)
        return job.future

    def submit_step(self, worker: Worker, plan: StepPlan,
                    then: Callable[[StepOutput], Any] | None = None) -> Future:
        """The future's result is the step's output, or then(output), run on this thread."""
        job = _Job(worker=worker, plan=plan, then=then)
        self._jobs.put(job)
        return job.future

    def shutdown(self, wait: bool = False) -> None:
        """Finishes what was submitted, then the thread ends; `wait`: returns once it has, unless
        called on that very thread."""
        self._jobs.put(None)
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def _loop(self) -> None:
        initializer, self._initializer = self._initializer, None
        if initializer is not None:
            initializer()
        in_flight: _Launched | None = None
        while True:
            # While it waits, the thread holds no job: a worker nothing else holds can be
            # collected, and its finalizer then ends this thread.
            job = ahead = None
            try:
                wait_s = None if in_flight is None else in_flight.step.fence.seconds_left()
                job = self._jobs.get(timeout=wait_s) if wait_s != 0 else self._jobs.get_nowait()
            except queue.Empty:
                self._finish(in_flight)
                in_flight = None
                continue
            if job is None:
                self._finish(in_flight)
                logger.debug("model thread %s stopped", self._thread.name)
                return
            if in_flight is not None and self._can_go_ahead(in_flight, job):
                ahead = self._launch(job, in_flight.step)
                self.num_launched_ahead += ahead is not None
                if not self._finish(in_flight) and ahead is not None:
                    self._fail(ahead, in_flight.step.step_id)
                    ahead = None
                in_flight = self._sample(ahead)
                continue
            self._finish(in_flight)
            in_flight = None
            if job.plan is None:
                self._run(job)
                continue
            in_flight = self._sample(self._launch(job, None))
            if in_flight is not None and not job.worker.runner.runs_apart:
                self._finish(in_flight)
                in_flight = None

    def _can_go_ahead(self, in_flight: _Launched, job: _Job) -> bool:
        if job.plan is None or job.worker is not in_flight.job.worker:
            return False
        try:
            return job.worker.can_launch_ahead(in_flight.step, job.plan)
        except Exception:  # the step then runs alone and its launch says what is wrong
            logger.exception("could not tell whether step %d may go ahead", job.plan.step_id)
            return False

    def _run(self, job: _Job) -> None:
        if not job.future.set_running_or_notify_cancel():
            return
        try:
            job.future.set_result(job.call())
        except BaseException as e:
            job.future.set_exception(e)

    def _launch(self, job: _Job, ahead_of: InFlightStep | None) -> _Launched | None:
        """None: it failed (its future says why)."""
        if not job.future.set_running_or_notify_cancel():
            return None
        try:
            return _Launched(job, job.worker.launch_step(job.plan, ahead_of))
        except BaseException as e:
            job.future.set_exception(e)
            return None

    def _sample(self, launched: _Launched | None) -> _Launched | None:
        if launched is None:
            return None
        try:
            launched.job.worker.sample_step(launched.step)
        except BaseException as e:
            launched.job.future.set_exception(e)
            return None
        return launched

    def _finish(self, launched: _Launched | None) -> bool:
        """False: the step failed."""
        if launched is None:
            return True
        job = launched.job
        try:
            output = job.worker.finish_step(launched.step)
            job.future.set_result(output if job.then is None else job.then(output))
        except BaseException as e:
            job.future.set_exception(e)
            return False
        time.sleep(0)  # the GIL to the thread that sends the result, before the next host work
        return True

    def _fail(self, launched: _Launched, failed_step_id: int) -> None:
        launched.job.worker.last_step_failed = True
        launched.job.future.set_exception(StepOutOfOrder(
            f"step {launched.step.step_id} was launched after step {failed_step_id}, which "
            "failed; ClearState first"))
