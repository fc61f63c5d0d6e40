"""A worker's steps between launch and finish, and the order they keep. Every rule of running
ahead on the worker's side is here:

- Order: a step runs only after the step it names (`previous_step_id`) in the scheduler's epoch,
  and none runs after a failed one until ClearState (reset). Steps are handed to the model
  thread in that order, whichever ExecuteStep RPC arrived first (`may_submit`).
- What may be launched ahead: where the device runs apart from the host (CUDA with one
  tensor-parallel rank, the simulated GPU), a step that follows the one in flight is launched
  before that one is finished, so the host's work on step n+1 (deltas, inputs, launch) overlaps
  the device's work on step n; its inputs read step n's draws on the device. Not a step that
  adds a token after one still being drawn: forks and beams draw several tokens per sequence,
  and the scheduler sends the tokens it chose only once it has read the draws; nor drafts
  proposed past a token still being drawn (they are verified after it).
- Finish order: the step in flight finishes before the one launched ahead of it is sampled;
  a step that cannot go ahead finishes the one in flight first, and so does a step whose
  predecessor is already done on the device; so does an idle queue once the device is done.
  Where the host is the device, every step finishes at once.
- Failure: a step that fails fails the step launched ahead of it (StepOutOfOrder), and every
  step after until reset.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagedserve.services.common.errors import StepOutOfOrder
from pagedserve.services.common.step_plan import StepOutput, StepPlan
from pagedserve.worker_svc.in_flight import InFlightStep

if TYPE_CHECKING:
    from pagedserve.worker_svc.model_runner import ModelRunner
    from pagedserve.worker_svc.worker import Worker

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Launched:
    step: InFlightStep
    runner: ModelRunner
    future: Future
    then: Callable[[StepOutput], Any] | None  # a step's output → the future's result


class LaunchWindow:
    def __init__(self) -> None:
        self.last_step_id = 0  # the step launched last in this epoch (0: none yet)
        self.submitted_step_id = 0  # the step handed to the model thread last in this epoch
        self.has_failed = False
        self.num_launched_ahead = 0
        self._in_flight: _Launched | None = None

    def reset(self) -> None:
        """A new epoch or ClearState: no step before, none failed."""
        self.last_step_id = self.submitted_step_id = 0
        self.has_failed = False

    def may_submit(self, plan: StepPlan) -> bool:
        return plan.previous_step_id <= self.submitted_step_id

    def check_order(self, plan: StepPlan) -> None:
        """Before a step's launch (a step refused here, or by its other checks, is no last
        step: the scheduler's next plan follows the step before)."""
        if plan.previous_step_id != self.last_step_id:
            raise StepOutOfOrder(f"step {plan.step_id} must follow step {plan.previous_step_id}, "
                                 f"but the worker's last step is {self.last_step_id}")
        if self.has_failed:
            raise StepOutOfOrder(f"step {plan.step_id} follows step {plan.previous_step_id}, "
                                 "which failed; ClearState first")

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Around a step's work: a step that raises there fails the steps after it."""
        try:
            yield
        except BaseException:
            self.has_failed = True
            raise

    def can_launch_ahead(self, in_flight: InFlightStep, plan: StepPlan,
                         runner: ModelRunner) -> bool:
        drawing = runner.mirrors.drawing
        return (runner.runs_apart and plan.previous_step_id == in_flight.step_id
                and not self.has_failed
                and not any((s.new_token_ids or s.draft_token_ids) and s.seq_id in drawing
                            for s in plan.running_seqs))

    @property
    def has_step_in_flight(self) -> bool:
        return self._in_flight is not None

    def seconds_left(self) -> float | None:
        """Until the step in flight is done on the device (None: none in flight)."""
        return None if self._in_flight is None else self._in_flight.step.fence.seconds_left()

    def launch(self, worker: Worker, plan: StepPlan, future: Future,
               then: Callable[[StepOutput], Any] | None = None) -> None:
        """On the model thread. `future` gets the step's output, or then(output)."""
        in_flight = self._in_flight
        # a step done on the device is finished first: its draws reach the host (and the next
        # masks start) before this launch, which has nothing left to overlap
        if (in_flight is None or self.seconds_left() == 0
                or not self._may_go_ahead(worker, in_flight, plan)):
            self.finish()
            self._in_flight = self._sample(self._launch(worker, plan, future, then, None))
            if self._in_flight is not None and not self._in_flight.runner.runs_apart:
                self.finish()
            return
        ahead = self._launch(worker, plan, future, then, in_flight.step)
        self.num_launched_ahead += ahead is not None
        self._in_flight = None
        if not self._finish(in_flight) and ahead is not None:
            self._fail(ahead, in_flight.step.step_id)
            ahead = None
        self._in_flight = self._sample(ahead)

    def finish(self) -> None:
        """The step in flight, if any."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            self._finish(in_flight)

    def _may_go_ahead(self, worker: Worker, in_flight: _Launched, plan: StepPlan) -> bool:
        try:
            return self.can_launch_ahead(in_flight.step, plan, worker.runner)
        except Exception:  # the step then runs alone and its launch says what is wrong
            logger.exception("could not tell whether step %d may go ahead", plan.step_id)
            return False

    def _launch(self, worker: Worker, plan: StepPlan, future: Future,
                then: Callable[[StepOutput], Any] | None,
                ahead_of: InFlightStep | None) -> _Launched | None:
        """None: it failed (its future says why)."""
        if not future.set_running_or_notify_cancel():
            return None
        try:
            return _Launched(worker.launch_step(plan, ahead_of), worker.runner, future, then)
        except BaseException as e:
            future.set_exception(e)
            return None

    def _sample(self, launched: _Launched | None) -> _Launched | None:
        if launched is None:
            return None
        try:
            with self.failing():
                launched.runner.sample(launched.step)
        except BaseException as e:
            launched.future.set_exception(e)
            return None
        return launched

    def _finish(self, launched: _Launched) -> bool:
        """False: the step failed."""
        try:
            with self.failing():
                output = launched.runner.finish(launched.step)
            launched.future.set_result(output if launched.then is None else launched.then(output))
        except BaseException as e:
            launched.future.set_exception(e)
            return False
        time.sleep(0)  # the GIL to the thread that sends the result, before the next host work
        return True

    def _fail(self, launched: _Launched, failed_step_id: int) -> None:
        self.has_failed = True
        launched.future.set_exception(StepOutOfOrder(
            f"step {launched.step.step_id} was launched after step {failed_step_id}, which "
            "failed; ClearState first"))
