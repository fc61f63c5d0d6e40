"""What one schedule() call chose: the sequences it runs, the groups it rejected or swapped out,
and the StepPlan that carries it to the workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.deltas import sequence_deltas
from pagedserve.scheduler_svc.sequence import Sequence, SequenceGroup
from pagedserve.services.common.step_plan import StepPlan


@dataclass(slots=True)
class ScheduledSequence:
    group: SequenceGroup
    seq: Sequence
    num_scheduled_tokens: int
    num_samples: int
    is_sampling: bool  # the worker samples for it: this step computes up to its last known token
    # speculative tokens after its last known one (in num_scheduled_tokens); None: not proposed;
    # PLACEHOLDER_TOKEN_ID each where the worker's draft model proposes them
    draft_token_ids: list[int] | None = None

    @property
    def num_known_tokens(self) -> int:
        """Its scheduled tokens less the drafts: those the step surely computes."""
        return self.num_scheduled_tokens - len(self.draft_token_ids or ())


@dataclass(slots=True)
class ScheduledStep:
    plan: StepPlan | None  # None: nothing for the workers this step
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    rejected: list[SequenceGroup] = field(default_factory=list)  # finished with an error here
    swapped_out: list[SequenceGroup] = field(default_factory=list)  # their KV moves this step
    # the host tier's copies among the plan's swaps
    num_blocks_offloaded: int = 0
    num_blocks_onloaded: int = 0
    # speculation: False when it carries drafts or schedules a speculating sequence
    may_run_ahead: bool = True


@dataclass(slots=True)
class StepDraft:
    """What schedule() accumulates before it becomes a StepPlan."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    rejected: list[SequenceGroup] = field(default_factory=list)
    swapped_out: list[SequenceGroup] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    has_preempted: bool = False
    num_long_prefills: int = 0
    is_long_limit_lifted: bool = False  # the second pass: the budget left goes to deferred ones
    capped: list[ScheduledSequence] = field(default_factory=list)  # long chunks, topped up last
    # a prompt besides the capped long ones is prefilled: its first (or next) token waits for
    # the step to end, so the long prefills are not topped up
    has_other_prefill: bool = False
    # a pass may have left a prefill out (deferred, or short of budget or room): only then does
    # the second pass look for one
    may_leave_prefills: bool = False

    @property
    def has_work(self) -> bool:
        return bool(self.scheduled or self.blocks_to_swap_out or self.blocks_to_swap_in
                    or self.blocks_to_copy)

    def to_plan(self, block_manager: BlockManager, scheduler_epoch: int, step_id: int,
                previous_step_id: int, finished_seq_ids: list[int],
                preempted_seq_ids: list[int]) -> StepPlan:
        """Records in each sequence what its worker mirror will hold."""
        deltas = sequence_deltas(self.scheduled, block_manager)
        return StepPlan(
            scheduler_epoch=scheduler_epoch, step_id=step_id, previous_step_id=previous_step_id,
            new_seqs=deltas.new_seqs, running_seqs=deltas.running_seqs,
            decode_seq_ids=deltas.decode_seq_ids,
            decode_block_ids_start=deltas.decode_block_ids_start,
            finished_seq_ids=finished_seq_ids,
            preempted_seq_ids=preempted_seq_ids, blocks_to_swap_out=self.blocks_to_swap_out,
            blocks_to_swap_in=self.blocks_to_swap_in, blocks_to_copy=self.blocks_to_copy)
