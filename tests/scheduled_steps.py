"""What an engine core schedules, step by step: which outputs of which request each step ran, and
which of those requests' outputs held KV blocks then. Tests of stopping one output read it."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler_svc.engine_core import EngineCore


@dataclass(slots=True)
class StepRecord:
    ran: set[tuple[str, int]] = field(default_factory=set)  # (request_id, output index)
    holding_blocks: set[tuple[str, int]] = field(default_factory=set)


class ScheduledSteps:
    def __init__(self, core: EngineCore) -> None:
        """Records every step `core` schedules from now on (on whatever thread steps it)."""
        self.steps: list[StepRecord] = []
        schedule = core.scheduler.schedule
        block_manager = core.block_manager

        def recording():
            scheduled = schedule()
            step = StepRecord()
            for item in scheduled.scheduled:
                step.ran.add((item.group.request_id, item.seq.index))
                step.holding_blocks.update((item.group.request_id, seq.index)
                                           for seq in item.group.seqs
                                           if block_manager.has_seq(seq.seq_id))
            self.steps.append(step)
            return scheduled

        core.scheduler.schedule = recording

    def num_steps(self, request_id: str, index: int) -> int:
        return sum((request_id, index) in step.ran for step in self.steps)

    def steps_after_finish(self, request_id: str, finished: int, sibling: int
                           ) -> list[StepRecord]:
        """The steps that ran `sibling` after the last one that ran `finished`."""
        key = (request_id, finished)
        last = max(i for i, step in enumerate(self.steps) if key in step.ran)
        return [step for step in self.steps[last + 1:] if (request_id, sibling) in step.ran]

    def assert_finished_early(self, request_id: str, finished: int, sibling: int,
                              min_steps_after: int) -> None:
        """`finished` stopped running, and holding blocks, while `sibling` ran on for at least
        `min_steps_after` steps."""
        after = self.steps_after_finish(request_id, finished, sibling)
        assert len(after) >= min_steps_after, (
            f"output {sibling} ran {len(after)} steps after output {finished} ran its last "
            f"({self.num_steps(request_id, finished)} steps)")
        held = [step for step in after if (request_id, finished) in step.holding_blocks]
        assert not held, f"output {finished} held blocks in {len(held)} of those steps"


def stop_string(texts: list[str]) -> str:
    """A stop string for output 0 alone: its shortest start (of at least 4 characters) that
    output 1 never holds."""
    first, second = texts
    for end in range(4, len(first)):
        if first[:end] not in second:
            return first[:end]
    raise AssertionError(f"output 0 {first!r} is inside output 1 {second!r}")
