"""The engine steps in flight: sent to the workers, their outputs not taken in yet, oldest first.
With async scheduling the scheduler plans step n+1 while step n runs, so the workers never wait
for it. Every rule of running ahead on the scheduler's side is here:

- At most two steps are in flight. The second goes out only behind a step that draws one token
  per sampling sequence: a step whose outputs fork sequences (best_of at the end of a prompt) or
  pick beams changes which sequences exist, so the step after it is planned from its outputs;
  so does a step that speculation holds (ScheduledStep.may_run_ahead: a verified step appends
  an unknown number of tokens, and drafts are proposed from known tokens).
- Sending a step behind another advances that one first: its scheduled tokens count as computed
  and each sequence it samples for ends in a placeholder for the token being drawn, so the new
  plan is the one that follows it. Taking a step's outputs in drops its placeholders.
- The step behind goes out as soon as the oldest step's tokens are in, before their reports are
  built, unless the caller holds it back (operations queued that belong in its plan).
- Steps finish in the order sent, and the workers run them in that order (each plan names the
  step before it).
- A failed step fails every step sent after it (the workers refuse those until ClearState): the
  window empties and their placeholders are dropped.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagedserve.scheduler_svc.scheduled_step import ScheduledStep
from pagedserve.services.common.step_plan import StepOutput


class StepFuture(Protocol):
    def result(self, timeout: float | None = None) -> StepOutput: ...


@dataclass(slots=True)
class SentStep:
    scheduled: ScheduledStep
    futures: list[StepFuture]  # one per worker rank
    handle: Any = None  # from StepObserver.step_sent
    schedule_time_s: float = 0.0
    is_advanced: bool = False  # counted as done for the plan sent behind it

    def result(self) -> StepOutput:
        """Rank 0's output, once every rank is done; the first failure raises."""
        self.wait()
        results = [future.result() for future in self.futures]
        step_id = self.scheduled.plan.step_id
        if results[0].step_id != step_id:
            raise RuntimeError(f"rank 0 answered step_id {results[0].step_id} to step_id {step_id}")
        return results[0]

    def wait(self) -> None:
        for future in self.futures:
            with contextlib.suppress(Exception):
                future.result()

    @property
    def has_forks_or_beams(self) -> bool:
        """A sequence draws several tokens: best_of candidates, or beam search's."""
        return any(item.num_samples != 1 for item in self.scheduled.scheduled if item.is_sampling)

    def advance(self) -> None:
        for item in self.scheduled.scheduled:
            seq = item.seq
            if seq.is_finished:  # finished or aborted after the step was sent
                continue
            seq.num_computed_tokens += item.num_scheduled_tokens
            if item.is_sampling and not item.group.pooling_type:  # an embedding draws nothing
                seq.add_placeholder()
        self.is_advanced = True

    def take_in(self) -> None:
        """Before its outputs are applied: its tokens computed, no placeholder left."""
        for item in self.scheduled.scheduled:
            seq = item.seq
            seq.drop_placeholder()
            if not self.is_advanced and not seq.is_finished:
                seq.num_computed_tokens += item.num_known_tokens

    def drop_placeholders(self) -> None:
        for item in self.scheduled.scheduled:
            item.seq.drop_placeholder()


class StepWindow:
    def __init__(self, is_async: bool) -> None:
        """`is_async`: whether a step may be sent behind the one in flight at all."""
        self.is_async = is_async
        self._steps: collections.deque[SentStep] = collections.deque()

    def __len__(self) -> int:
        return len(self._steps)

    def fill(self, send: Callable[[], SentStep | None]) -> None:
        """A step if none is in flight, then the one behind it if it may run ahead. `send`
        plans and sends a step; None: nothing to run."""
        if not self._steps:
            self._push(send())
        self.send_behind(send)

    def send_behind(self, send: Callable[[], SentStep | None]) -> None:
        if len(self._steps) != 1 or not self.is_async:
            return
        oldest = self._steps[0]
        if oldest.is_advanced or oldest.has_forks_or_beams or not oldest.scheduled.may_run_ahead:
            return  # advanced already: the plan sent behind it was empty
        oldest.advance()
        self._push(send())

    def pop_oldest(self) -> SentStep | None:
        return self._steps.popleft() if self._steps else None

    def fail(self, failed: SentStep) -> list[SentStep]:
        """`failed` (popped already) and the steps sent after it, once their workers are done."""
        steps = [failed, *self._steps]
        self._steps.clear()
        for step in steps[1:]:
            step.wait()
        for step in steps:
            step.drop_placeholders()
        return steps

    def _push(self, step: SentStep | None) -> None:
        if step is not None:
            self._steps.append(step)
