"""Fairness between prefills: a long prompt's chunk is capped at the threshold while the step's
other requests are scheduled, so a shorter prompt runs, whole, in the first step planned after
it reached the scheduler. With async scheduling that is step n+2 for a request that arrived while
step n ran (the engine plans no step past a queued arrival; n+1 was sent with n): its first token
comes with the second step to end after its arrival, however long the prefill beside it.

A step that prefills another prompt stays short: the long prefill keeps its cap there. In every
other step (alone, or beside decodes only) it tops up on the budget the others leave, so it loses
at most one capped step per prompt that passes it. The steps already sent at an arrival hold up
to max_num_batched_tokens tokens each: the budget bounds the wait in seconds. Prompts over the
threshold take turns (max_long_partial_prefills) unless budget is left over."""

from __future__ import annotations

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence
from pagedserve.scheduler_svc.sequence import SequenceGroup
from pagedserve.services.common.config import SchedulerConfig


def long_prefill_threshold(config: SchedulerConfig, max_model_len: int) -> int:
    """The configured threshold (0: 4% of max_model_len, at least 64), never above half the
    token budget, so a capped long prefill always leaves room for the others."""
    threshold = config.long_prefill_token_threshold or max(64, max_model_len * 4 // 100)
    return max(1, min(threshold, config.max_num_batched_tokens // 2))


def long_prefill_cap(group: SequenceGroup, threshold: int) -> int | None:
    """None: not a long prefill."""
    if group.is_decode_phase():
        return None
    live = group.live_seqs()
    return threshold if live and live[0].num_uncomputed_tokens > threshold else None


def top_up(block_manager: BlockManager, capped: list[ScheduledSequence],
           num_tokens_left: int) -> tuple[list[tuple[int, int]], int]:
    """Give the tokens the step left to the capped single-sequence prefills, in order, as far as
    free blocks allow. Returns the copy-on-write pairs and the tokens added."""
    blocks_to_copy: list[tuple[int, int]] = []
    num_added = 0
    for item in capped:
        seq = item.seq
        num_extra = min(num_tokens_left - num_added,
                        seq.num_uncomputed_tokens - item.num_scheduled_tokens)
        if num_extra <= 0 or seq.is_finished:
            continue
        num_total = seq.num_computed_tokens + item.num_scheduled_tokens + num_extra
        num_new = max(0, num_total - block_manager.num_tokens(seq.seq_id))
        if not block_manager.can_append_slots([seq.seq_id], [num_new]):
            continue
        blocks_to_copy += block_manager.append_slots(seq.seq_id, num_total)
        item.num_scheduled_tokens += num_extra
        item.is_sampling = num_total == len(seq.token_ids)
        num_added += num_extra
    return blocks_to_copy, num_added
