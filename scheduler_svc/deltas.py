"""The StepPlan deltas that bring each worker mirror up to date. A sequence the worker does not
know (`worker_block_ids is None`) goes whole; a known one sends new tokens and the changed tail
of its block table, which only grows or has blocks replaced, so one (start, ids) pair suffices.
The block manager counts the leading blocks left in place since the table was last sent, so a
decoding sequence's table is neither copied nor compared.
A single sampled token is appended by the worker itself, so it counts as known. A plain decode
(one token, one sample, nothing new for the mirror) goes packed: its seq_id and block_ids_start
only, as the wire carries it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.sequence import PLACEHOLDER_TOKEN_ID
from pagedserve.services.common.step_plan import NewSequence, RunningSequence

if TYPE_CHECKING:  # scheduled_step builds its plan from these deltas
    from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence


@dataclass(slots=True)
class SequenceDeltas:
    """A step's deltas in StepPlan's fields."""

    new_seqs: list[NewSequence] = field(default_factory=list)
    running_seqs: list[RunningSequence] = field(default_factory=list)
    decode_seq_ids: list[int] = field(default_factory=list)
    decode_block_ids_start: list[int] = field(default_factory=list)


def sequence_deltas(
    scheduled: list[ScheduledSequence], block_manager: BlockManager,
) -> SequenceDeltas:
    """The worker appends a verified step's accepted drafts too; the scheduler counts those when
    the step's output comes (OutputProcessor)."""
    deltas = SequenceDeltas()
    for item in scheduled:
        group, seq, num_scheduled_tokens = item.group, item.seq, item.num_scheduled_tokens
        num_samples, drafts = item.num_samples, item.draft_token_ids or []
        num_lookahead_slots = 0
        if drafts and drafts[0] == PLACEHOLDER_TOKEN_ID:  # the worker's draft model proposes
            num_lookahead_slots, drafts = len(drafts), []
        block_ids, num_stable = block_manager.take_block_table(seq.seq_id)
        known = seq.worker_block_ids
        if known is None:
            seq.worker_block_ids = list(block_ids)
            deltas.new_seqs.append(NewSequence(
                seq_id=seq.seq_id, request_id=group.request_id, token_ids=list(seq.token_ids),
                prompt_len=seq.prompt_len, block_ids=list(block_ids),
                num_computed_tokens=seq.num_computed_tokens,
                num_scheduled_tokens=num_scheduled_tokens, sampling=group.sampling,
                seed=seq.seed, num_samples=num_samples, pooling_type=group.pooling_type,
                draft_token_ids=drafts, num_lookahead_slots=num_lookahead_slots))
        else:
            start = _block_ids_start(known, block_ids, num_stable)
            # a plain decode (drafts and lookahead slots count in num_scheduled_tokens)
            if (num_scheduled_tokens == 1 and num_samples == 1
                    and start == len(known) == len(block_ids)
                    and seq.num_worker_tokens == len(seq.token_ids)):
                deltas.decode_seq_ids.append(seq.seq_id)
                deltas.decode_block_ids_start.append(start)
            else:
                changed = block_ids[start:]
                known[start:] = changed  # the mirror's copy, updated where it changed
                # positional: a frozen dataclass's keywords cost ~40% more
                deltas.running_seqs.append(RunningSequence(
                    seq.seq_id, seq.token_ids[seq.num_worker_tokens:], start, changed,
                    num_scheduled_tokens, num_samples, drafts, num_lookahead_slots))
        seq.num_worker_tokens = len(seq.token_ids) + (
            item.is_sampling and num_samples == 1 and not group.pooling_type)
    return deltas


def _block_ids_start(known: list[int], block_ids: list[int], num_stable: int) -> int:
    """Where `block_ids` first differs from `known`, the scheduler's copy of the mirror's block
    table."""
    num_known = len(known)
    if num_stable >= num_known:  # appended to at most: the usual decode
        return num_known
    # blocks replaced (copy-on-write) or dropped (trimmed drafts) past num_stable
    return num_stable + _first_difference(known[num_stable:], block_ids[num_stable:])


def _first_difference(old: list[int], new: list[int]) -> int:
    """Appends (the usual change) and no change are found by C-level list compares."""
    if new[:len(old)] == old:
        return len(old)
    for i, (a, b) in enumerate(zip(old, new, strict=False)):
        if a != b:
            return i
    return min(len(old), len(new))
