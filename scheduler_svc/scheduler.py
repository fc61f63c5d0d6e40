"""The scheduler: three queues (waiting, running, swapped), preemption, and the StepPlan.

It owns every sequence's place in the queues and, through the BlockManager, its blocks, and
tracks what each worker mirror holds so every StepPlan carries deltas only."""

from __future__ import annotations

import logging
import time
from collections import deque

from pagedserve.scheduler_svc.block_manager import AllocStatus, BlockManager
from pagedserve.scheduler_svc.prefill_fairness import (
    long_prefill_cap,
    long_prefill_threshold,
    top_up,
)
from pagedserve.scheduler_svc.queue_policy import (
    outranks_swapped,
    preempt_for_priority,
    preemption_key,
    rank,
    sort_queue,
)
from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence, ScheduledStep, StepDraft
from pagedserve.scheduler_svc.sequence import Sequence, SequenceGroup, SequenceStatus
from pagedserve.scheduler_svc.spec_decode import Speculator
from pagedserve.scheduler_svc.token_budget import TokenBudget, assign_decode, assign_tokens
from pagedserve.services.common.cdiv import cdiv
from pagedserve.services.common.config import SchedulerConfig
from pagedserve.services.common.outputs import FinishReason

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, max_model_len: int,
                 scheduler_epoch: int = 0) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.scheduler_epoch = scheduler_epoch
        self.long_prefill_token_threshold = long_prefill_threshold(config, max_model_len)
        self.waiting: deque[SequenceGroup] = deque()
        self.running: deque[SequenceGroup] = deque()
        self.swapped: deque[SequenceGroup] = deque()
        self.num_preemptions = 0
        self._step_id = 0
        self._previous_step_id = 0  # the last plan sent in this epoch (0: none yet)
        # mirrors to drop, sent with the next plan that goes out
        self._finished_seq_ids: list[int] = []
        self._preempted_seq_ids: list[int] = []
        speculative = config.speculative
        self.speculator = (Speculator(speculative, max_model_len, config.async_scheduling)
                           if speculative is not None else None)

    def add_group(self, group: SequenceGroup) -> None:
        self.waiting.append(group)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def has_runnable(self) -> bool:
        """Some unfinished group is not paused: schedule() may have work."""
        return any(not g.is_paused for queue in (self.waiting, self.running, self.swapped)
                   for g in queue)

    @property
    def num_paused(self) -> int:
        return sum(g.is_paused for queue in (self.waiting, self.running, self.swapped)
                   for g in queue)

    def finish_group(self, group: SequenceGroup, reason: FinishReason,
                     error: str | None = None) -> None:
        group.finish(reason, error)
        self.free_finished(group)

    def free_finished(self, group: SequenceGroup) -> None:
        num_finished = 0
        for seq in group.seqs:
            if seq.is_finished:
                self.free_seq(seq)
                num_finished += 1
        if num_finished == len(group.seqs):
            for queue in (self.waiting, self.running, self.swapped):
                if group in queue:
                    queue.remove(group)

    def free_seq(self, seq: Sequence) -> None:
        """Idempotent."""
        if seq.is_known_to_worker:
            self._finished_seq_ids.append(seq.seq_id)
            seq.worker_block_ids = None
        self.block_manager.free(seq.seq_id)
        if self.speculator is not None:
            self.speculator.forget(seq.seq_id)

    def fork_seq(self, parent: Sequence, child: Sequence) -> None:
        self.block_manager.fork(parent.seq_id, child.seq_id)
        child.worker_block_ids = None

    def forget_worker_state(self) -> None:
        """The workers lost their mirrors (ClearState after a failed step)."""
        self._previous_step_id = 0
        for queue in (self.running, self.swapped, self.waiting):
            for group in queue:
                for seq in group.seqs:
                    seq.worker_block_ids = None
        self._finished_seq_ids.clear()
        self._preempted_seq_ids.clear()

    def recompute_all(self) -> int:
        """Every KV block is gone (a worker restarted): requeue every running and swapped request
        ahead of the waiting ones, to be recomputed from its tokens. Returns the number."""
        groups = sorted([*self.running, *self.swapped], key=self._key)
        for group in groups:
            self._to_waiting(group.live_seqs())
        self.running.clear()
        self.swapped.clear()
        self.waiting.extendleft(reversed(groups))
        self.block_manager.reset_prefix_cache()
        return len(groups)

    def keep_verified(self, seq: Sequence, num_accepted: int) -> None:
        """After a verified step, for a sequence that goes on: its accepted drafts are computed
        (the worker appended them with the next token) and the rejected ones' slots go back."""
        seq.num_computed_tokens += num_accepted
        seq.num_worker_tokens += num_accepted
        self.block_manager.trim(seq.seq_id, seq.num_computed_tokens)

    def schedule(self) -> ScheduledStep:
        """Choose what runs in the next engine step and describe it as a StepPlan of deltas.

        Order (chunked prefill): decodes of running groups, their prefill chunks, then, only if
        nothing was preempted, swapped groups coming back and waiting prompts that outrank every
        swapped group -- within `max_num_batched_tokens` and `max_num_seqs`. Without chunked
        prefill a step is all whole prompts or all decodes, and a lone prompt may use up to
        max(max_num_batched_tokens, max_model_len) tokens. Long prefills share the budget
        (prefill_fairness: capped, then topped up unless the step prefills another prompt);
        under the priority policy a waiting group short of room first preempts lower-ranked
        running groups (queue_policy).

        A paused group (its consumer is behind) is skipped wherever it sits and keeps its blocks,
        but is the first preempted: when a running group cannot grow, and when a waiting or
        swapped group finds no room while a paused group holds blocks on the device.

        When a running group cannot get a block for its next token, a paused running group, else
        the lowest-ranked running group not yet scheduled this step, is preempted (possibly
        itself): by recompute for single-sequence groups, by swap for multi-sequence ones,
        unless `preemption_mode` says otherwise or there is no CPU room. A group that can never
        run (too long, more blocks than the device has) finishes with finish_reason "error" in
        `rejected`; the groups behind it proceed.

        The plan holds NewSequence for a sequence the workers do not know and RunningSequence
        deltas otherwise. A step with nothing to do yields `plan=None` and keeps the pending
        mirror drops for the next plan.
        """
        step = StepDraft()
        chunked = self.config.enable_chunked_prefill
        for queue in (self.waiting, self.running, self.swapped):
            sort_queue(queue, self.config.policy)
        if self.config.policy == "priority" and preempt_for_priority(
                self.waiting, self.running, self.swapped, self.block_manager,
                self.config.max_num_seqs, lambda victim: self._preempt(victim, step, "recompute")):
            sort_queue(self.waiting, self.config.policy)  # the victims went to its front
            step.has_preempted = False  # the room was made for `waiting`: admit it this step
        budget = TokenBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        if not chunked:
            budget.max_num_tokens = max(budget.max_num_tokens, self.max_model_len)
            self._schedule_waiting(budget, step)
            if step.scheduled:
                return self._build(step)
            budget.max_num_tokens = self.config.max_num_batched_tokens
        self._schedule_running(budget, step)
        if not step.has_preempted:
            self._schedule_swapped(budget, step)
            if chunked:
                self._schedule_waiting(budget, step)
        if not step.has_other_prefill:  # else the step stays short
            self._top_up(budget, step)
            if (chunked and step.may_leave_prefills and not step.has_preempted
                    and budget.remaining_tokens > 0):
                self._schedule_deferred_long(budget, step)
        return self._build(step)

    def _key(self, group: SequenceGroup) -> tuple[float, ...]:
        return rank(group, self.config.policy)

    def _schedule_running(self, budget: TokenBudget, step: StepDraft) -> None:
        decodes, prefills = [], []
        num_decoding_seqs = 0
        for group in self.running:
            if group.is_decode_phase():
                decodes.append(group)
                num_decoding_seqs += len(group.seqs)
            else:
                prefills.append(group)
        decoding = set(map(id, decodes))
        # decodes run first and take a block per sequence at most: while the pool holds one for
        # every decoding sequence, none needs checking (drafts may take more: checked then)
        decodes_fit = self.speculator is None and self.block_manager.can_append_decodes(
            num_decoding_seqs)
        step.may_leave_prefills = bool(prefills)
        pending = deque(decodes + prefills)
        skipped: list[SequenceGroup] = []  # running, not scheduled this step, still preemptible
        kept: list[SequenceGroup] = []
        while pending:
            group = pending.popleft()
            if group.is_paused:
                skipped.append(group)
                continue
            live = group.live_seqs()
            if self._is_drawing_last_token(group, live):
                kept.append(group)
                continue
            is_decode = id(group) in decoding
            if is_decode and decodes_fit:  # no room check, no preemption, no drafts
                (kept if self._add_decode(group, live, budget, step) else skipped).append(group)
                continue
            if is_decode:  # no prefill: no cap, no deferral
                cap = None
                assignment = assign_decode(live, budget)
            else:
                cap = self._long_prefill_cap(group)
                if self._is_deferred(cap, step):
                    skipped.append(group)
                    continue
                assignment = assign_tokens(group, budget, self.config.enable_chunked_prefill, cap)
            if assignment is None:
                skipped.append(group)
                continue
            while not self._can_append(assignment):
                candidates = [*pending, *skipped]
                victim = max(candidates, key=self._preemption_key) if candidates else group
                if victim is group and not kept:  # alone on the device, it still cannot grow
                    self._fail(group, step, "its sequences need more KV-cache blocks than the "
                               f"device has (num_gpu_blocks={self.block_manager.num_gpu_blocks})")
                    break
                if victim is not group:
                    (pending if victim in pending else skipped).remove(victim)
                self._preempt(victim, step)
                if victim is group:
                    break
            else:
                self._add(group, assignment, budget, step, is_decode, is_long=cap is not None)
                kept.append(group)
        self.running = deque(kept + skipped)

    def _is_drawing_last_token(self, group: SequenceGroup, live: list[Sequence]) -> bool:
        """The step in flight draws each live sequence's last token (its length ends it once
        taken in): a step behind it would compute a token no one reads, and the room it takes
        would hold a waiting prompt back a step. `live`: the group's live sequences."""
        max_tokens = group.sampling.max_tokens
        for seq in live:
            num_tokens = len(seq.token_ids)
            if not (seq.has_placeholder and (num_tokens - seq.prompt_len >= max_tokens
                                             or num_tokens >= self.max_model_len)):
                return False
        return bool(live)

    def _schedule_swapped(self, budget: TokenBudget, step: StepDraft) -> None:
        for group in [g for g in self.swapped if not g.is_paused]:
            seq_ids = [s.seq_id for s in group.live_seqs()]
            assignment = assign_tokens(group, budget, self.config.enable_chunked_prefill)
            if assignment is None:
                return
            while not self._can_swap_in(seq_ids):
                if not self._preempt_paused(step):
                    return
            self.swapped.remove(group)
            step.blocks_to_swap_in += self.block_manager.swap_in(seq_ids)
            for seq in group.live_seqs():
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            # back on the device; it runs next step (or is preempted again). No prefill is left
            # out here: a prompt's blocks are all allocated at admission, so a group that cannot
            # grow is decoding, which the second pass for prefills does not look at
            if not self._can_append(assignment):
                continue
            self._add(group, assignment, budget, step, group.is_decode_phase())

    def _schedule_waiting(self, budget: TokenBudget, step: StepDraft) -> None:
        """Long prompts that find every long-prefill slot taken keep their place in `waiting`;
        the prompts behind them pass."""
        passed: list[SequenceGroup] = []
        try:
            self._admit_waiting(budget, step, passed)
        finally:
            self.waiting.extendleft(reversed(passed))

    def _admit_waiting(self, budget: TokenBudget, step: StepDraft, passed: list[SequenceGroup]) -> None:
        while self.waiting and budget.remaining_tokens > 0:
            group = self.waiting[0]
            if group.is_paused:
                passed.append(self.waiting.popleft())
                continue
            if not outranks_swapped(group, self.swapped, self.config.policy):
                return
            live = group.live_seqs()
            if not group.is_admitted and group.prompt_len >= self.max_model_len:
                self._reject(group, step, f"prompt has {group.prompt_len} tokens; it must be "
                             f"shorter than max_model_len={self.max_model_len}")
                continue
            cap = self._long_prefill_cap(group)
            if self._is_deferred(cap, step):
                step.may_leave_prefills = True
                passed.append(self.waiting.popleft())
                continue
            if budget.remaining_seqs < len(live):
                return
            # a prefix hit would skip the positions whose prompt logprobs are still owed (vLLM),
            # or whose hidden states a mean pooling sums
            use_prefix_cache = (not group.is_collecting_prompt_logprobs
                                and group.pooling_type != "mean")
            status = self._allocate(live, use_prefix_cache)
            while status is AllocStatus.LATER and self._preempt_paused(step):
                status = self._allocate(live, use_prefix_cache)
            if status is AllocStatus.LATER and self._free_finishing():
                status = self._allocate(live, use_prefix_cache)
            if status is AllocStatus.LATER and not self.running and self._is_pool_idle():
                status = AllocStatus.NEVER  # several sequences that do not fit side by side
            if status is AllocStatus.NEVER:
                self._reject(group, step, f"{len(live[0].token_ids)} tokens need more KV-cache "
                             f"blocks than the device has "
                             f"(num_gpu_blocks={self.block_manager.num_gpu_blocks})")
                continue
            if status is AllocStatus.LATER:
                return
            if not group.is_admitted:
                group.is_admitted = True
                group.first_scheduled_time = time.monotonic()
                group.num_cached_tokens = live[0].num_computed_tokens
                if group.sampling.prompt_logprobs is not None:
                    group.prompt_logprobs = [None] * group.num_cached_tokens
            cap = self._long_prefill_cap(group)  # prefix-cache hits may have shortened it
            if step.is_long_limit_lifted:
                cap = None
            assignment = assign_tokens(group, budget, self.config.enable_chunked_prefill, cap)
            if assignment is None:  # whole prompts only, and this one does not fit any more
                self._to_waiting(live)
                return
            self.waiting.popleft()
            for seq in live:
                seq.status = SequenceStatus.RUNNING
            self.running.append(group)
            self._add(group, assignment, budget, step, group.is_decode_phase(),
                      is_long=cap is not None)

    def _free_finishing(self) -> bool:
        """Frees the blocks of the running groups whose last tokens the step in flight draws,
        for a waiting prompt that finds no room: the step planned now runs after that one, and
        the workers order any copy into those blocks behind it, so the prompt need not wait a
        step more for the finish to be taken in. The blocks that step fills enter the prefix
        cache now (any reader runs after it), as they would have once it ran. Not for beams or
        candidates about to fork: their outputs still pick among blocks. Returns whether any
        block was freed."""
        bm = self.block_manager
        finishing = []
        for group in self.running:
            if group.is_paused or group.is_beam_search or group.num_samples() != 1:
                continue
            live = group.live_seqs()
            if self._is_drawing_last_token(group, live):
                finishing += [seq for seq in live if bm.has_seq(seq.seq_id)]
        for seq in finishing:
            bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            self.free_seq(seq)
        return bool(finishing)

    def _is_deferred(self, cap: int | None, step: StepDraft) -> bool:
        """A long prefill over this step's long-prefill limit waits for the second pass."""
        return (cap is not None and not step.is_long_limit_lifted
                and step.num_long_prefills >= self.config.max_long_partial_prefills)

    def _schedule_deferred_long(self, budget: TokenBudget, step: StepDraft) -> None:
        """Work conservation: the budget everything else left goes to the long prefills the
        limit deferred, running ones first, in queue order, uncapped and without preempting."""
        step.is_long_limit_lifted = True
        prefilling = [g for g in self.running if not g.is_paused and not g.is_decode_phase()]
        scheduled = {id(item.group) for item in step.scheduled} if prefilling else set()
        for group in prefilling:
            if id(group) in scheduled:
                continue
            assignment = assign_tokens(group, budget, self.config.enable_chunked_prefill)
            if assignment is not None and self._can_append(assignment):
                self._add(group, assignment, budget, step, is_decode=False)
        self._schedule_waiting(budget, step)

    def _preempt_paused(self, step: StepDraft) -> bool:
        """Frees the device blocks of the paused running group preempted first, if any."""
        paused = [g for g in self.running if g.is_paused]
        if not paused:
            return False
        victim = max(paused, key=self._preemption_key)
        self.running.remove(victim)
        self._preempt(victim, step)
        if self.waiting and self.waiting[0] is victim:  # keep the group being admitted first
            self.waiting.rotate(-1)
        return True

    def _preemption_key(self, group: SequenceGroup) -> tuple[float, ...]:
        return preemption_key(group, self.config.policy)

    def _is_pool_idle(self) -> bool:
        bm = self.block_manager
        return bm.num_free_gpu_blocks == bm.num_gpu_blocks

    def _allocate(self, seqs: list[Sequence], use_prefix_cache: bool = True) -> AllocStatus:
        """All or none."""
        done: list[Sequence] = []
        for seq in seqs:
            status = self.block_manager.can_allocate(seq.token_ids, use_prefix_cache)
            if status is not AllocStatus.OK:
                self._to_waiting(done)
                return status
            seq.num_computed_tokens = self.block_manager.allocate(seq.seq_id, seq.token_ids,
                                                                  use_prefix_cache)
            done.append(seq)
        return AllocStatus.OK

    def _long_prefill_cap(self, group: SequenceGroup) -> int | None:
        if not self.config.enable_chunked_prefill:
            return None
        return long_prefill_cap(group, self.long_prefill_token_threshold)

    def _can_swap_in(self, seq_ids: list[int]) -> bool:
        """Room to swap in plus a block per sequence to grow, so a group that comes back is not
        swapped straight out again -- unless nothing runs (else a group holding nearly the whole
        device would wait forever)."""
        bm = self.block_manager
        num_blocks = len({b for seq_id in seq_ids for b in bm.block_table(seq_id)})
        margin = len(seq_ids) if self.running else 0
        return bm.can_swap_in(seq_ids) and bm.num_free_gpu_blocks >= num_blocks + margin

    def _can_append(self, assignment: list[tuple[Sequence, int]]) -> bool:
        bm = self.block_manager
        num_tokens = bm.num_tokens
        return bm.can_append_slots(
            [seq.seq_id for seq, _ in assignment],
            [max(0, seq.num_computed_tokens + n - num_tokens(seq.seq_id))
             for seq, n in assignment])

    def _add(self, group: SequenceGroup, assignment: list[tuple[Sequence, int]],
             budget: TokenBudget, step: StepDraft, is_decode: bool, is_long: bool = False) -> None:
        """`is_decode`: the group is in its decode phase (`is_decode_phase`)."""
        num_samples = group.num_samples()
        for seq, num_tokens in assignment:
            drafts = None if self.speculator is None else self._propose(group, seq, num_tokens,
                                                                        budget)
            num_scheduled = num_tokens + len(drafts or ())
            step.blocks_to_copy += self.block_manager.append_slots(
                seq.seq_id, seq.num_computed_tokens + num_scheduled)
            is_sampling = seq.num_computed_tokens + num_tokens == len(seq.token_ids)
            step.scheduled.append(ScheduledSequence(group, seq, num_scheduled, num_samples,
                                                    is_sampling, drafts))
            budget.num_tokens += num_scheduled
        budget.num_seqs += len(assignment)
        is_capped = is_long and len(group.live_seqs()) == 1  # groups of several stop one short
        if is_long:
            step.num_long_prefills += 1
            if is_capped:
                step.capped.append(step.scheduled[-1])
        if not (is_decode or is_capped):
            step.has_other_prefill = True

    def _add_decode(self, group: SequenceGroup, live: list[Sequence], budget: TokenBudget,
                    step: StepDraft) -> bool:
        """`_add` for a decoding group whose room is known and that proposes no drafts: its live
        sequences a token each. False: they do not fit the budget."""
        num_seqs = len(live)
        if not budget.fits(num_seqs, num_seqs):
            return False
        num_samples = group.num_samples()
        append_slots = self.block_manager.append_slots
        scheduled = step.scheduled
        for seq in live:  # each computed up to its last token: this one, which it samples
            step.blocks_to_copy += append_slots(seq.seq_id, len(seq.token_ids))
            scheduled.append(ScheduledSequence(group, seq, 1, num_samples, True))
        budget.num_tokens += num_seqs
        budget.num_seqs += num_seqs
        return True

    def _propose(self, group: SequenceGroup, seq: Sequence, num_tokens: int,
                 budget: TokenBudget) -> list[int] | None:
        """Drafts for a decoding sequence, within the step's token budget and only where their
        extra blocks leave one free block per running group (speculation never preempts)."""
        if num_tokens != 1 or seq.num_uncomputed_tokens != 1:
            return None
        drafts = self.speculator.propose(group, seq, budget.remaining_tokens - num_tokens,
                                         len(self.running))
        if drafts:
            bm = self.block_manager
            num_tokens_after = len(seq.token_ids)
            num_extra = (cdiv(num_tokens_after + len(drafts), bm.block_size)
                         - cdiv(num_tokens_after, bm.block_size))
            if num_extra and (bm.num_free_gpu_blocks - num_extra
                              < len(self.running) + bm.watermark_blocks):
                return None
        return drafts

    def _keep_drafts_that_pay(self, scheduled: list[ScheduledSequence]) -> None:
        """Cuts the drafts the step's cost says do not pay; their slots go back."""
        kept = self.speculator.drafts_that_pay(scheduled)
        for item, num_kept in zip(scheduled, kept, strict=True):
            drafts = item.draft_token_ids
            if drafts is None or num_kept == len(drafts):
                continue
            item.num_scheduled_tokens -= len(drafts) - num_kept
            item.draft_token_ids = drafts[:num_kept]
            self.block_manager.trim(item.seq.seq_id,
                                    item.seq.num_computed_tokens + item.num_scheduled_tokens)

    def _top_up(self, budget: TokenBudget, step: StepDraft) -> None:
        blocks_to_copy, num_added = top_up(self.block_manager, step.capped,
                                           budget.remaining_tokens)
        step.blocks_to_copy += blocks_to_copy
        budget.num_tokens += num_added

    def _preempt(self, group: SequenceGroup, step: StepDraft, mode: str | None = None) -> None:
        live = group.live_seqs()
        seq_ids = [s.seq_id for s in live]
        mode = mode or self.config.preemption_mode
        if group.pooling_type:  # a mean's running sum lives in the worker mirror a swap drops
            mode = "recompute"
        elif mode == "auto":
            mode = "recompute" if len(live) == 1 else "swap"
        if mode == "swap" and not self.block_manager.can_swap_out(seq_ids):
            logger.warning("no CPU swap space for request %s; preempting by recompute",
                           group.request_id)
            mode = "recompute"
        self.num_preemptions += 1
        step.has_preempted = True
        for seq in live:
            if seq.is_known_to_worker:
                self._preempted_seq_ids.append(seq.seq_id)
                seq.worker_block_ids = None
            if self.speculator is not None:
                self.speculator.preempted(seq)
        if mode == "swap":
            step.blocks_to_swap_out += self.block_manager.swap_out(seq_ids)
            step.swapped_out.append(group)
            for seq in live:
                seq.status = SequenceStatus.SWAPPED
            self.swapped.append(group)
        else:
            self._to_waiting(live)
            self.waiting.appendleft(group)
        logger.debug("preempted request %s by %s", group.request_id, mode)

    def _to_waiting(self, seqs: list[Sequence]) -> None:
        for seq in seqs:
            self.block_manager.free(seq.seq_id)
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING

    def _reject(self, group: SequenceGroup, step: StepDraft, message: str) -> None:
        self.waiting.popleft()
        self._fail(group, step, message)

    def _fail(self, group: SequenceGroup, step: StepDraft, message: str) -> None:
        logger.warning("request %s rejected: %s", group.request_id, message)
        group.finish(FinishReason.ERROR, message)
        for seq in group.seqs:
            self.free_seq(seq)
        step.rejected.append(group)

    def _build(self, step: StepDraft) -> ScheduledStep:
        # onloads first: a GPU block freed and reused within the step ends with its last owner's KV
        offloads, onloads = self.block_manager.take_host_copies()
        step.blocks_to_swap_out += offloads
        step.blocks_to_swap_in[:0] = onloads
        out = ScheduledStep(plan=None, scheduled=step.scheduled, rejected=step.rejected,
                            swapped_out=step.swapped_out, num_blocks_offloaded=len(offloads),
                            num_blocks_onloaded=len(onloads))
        if self.speculator is not None:
            self._keep_drafts_that_pay(step.scheduled)
            out.may_run_ahead = not self.speculator.holds_back_run_ahead(step.scheduled,
                                                                         len(self.running))
        if not step.has_work:
            return out
        self._step_id += 1
        out.plan = step.to_plan(self.block_manager, self.scheduler_epoch, self._step_id,
                                self._previous_step_id, self._finished_seq_ids,
                                self._preempted_seq_ids)
        self._previous_step_id = self._step_id
        self._finished_seq_ids = []
        self._preempted_seq_ids = []
        return out
