"""Turns a worker's StepOutput into sequence state and RequestOutputs. Results of sequences that
finished or were aborted while the step ran are dropped; best_of > 1 samples best_of tokens at
the end of the prompt and forks there. Single samples are read from the step's packed lists
(most of a decode step): no SampledSequence is built for them."""

from __future__ import annotations

import itertools
import logging
import time

from pagedserve.scheduler_svc.beam_search import beam_search_step
from pagedserve.scheduler_svc.outputs import make_request_output
from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence, ScheduledStep
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.sequence import Sequence, SequenceGroup, SequenceStatus, derive_seed
from pagedserve.services.common.outputs import FinishReason, RequestOutput
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import SampledSequence, StepOutput, TokenIdLogprob

logger = logging.getLogger(__name__)

# a sample as apply() holds it: a SampledSequence, or the index of a packed single sample
Sample = SampledSequence | int


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: list[int], max_model_len: int,
                 seq_ids: itertools.count) -> None:
        self.scheduler = scheduler
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._seq_ids = seq_ids  # shared with whoever creates the first sequence of a group
        self.num_prompt_tokens = 0  # prompts that got their first token, since start
        self.num_generation_tokens = 0  # tokens appended to outputs, since start

    def apply(self, scheduled: ScheduledStep, step_output: StepOutput) -> list[SequenceGroup]:
        """The step's tokens into its sequences (stops, forks, freed blocks): what the next
        schedule needs, once SentStep.take_in counted its tokens. Returns the groups the step
        touched, for report()."""
        by_seq_id = {out.seq_id: out for out in step_output.outputs}
        packed = step_output.packed_indices()
        pooled = {p.seq_id: p.embedding for p in step_output.pooled}
        groups: dict[int, SequenceGroup] = {}
        samples: dict[int, list[tuple[Sequence, Sample]]] = {}
        drafts: dict[int, list[int] | None] = {}  # seq_id → its proposal, where one was made
        bm = self.scheduler.block_manager
        is_caching = bm.enable_prefix_caching
        for item in scheduled.scheduled:
            group, seq = item.group, item.seq
            groups[id(group)] = group
            if seq.is_finished:  # while the step ran, or failed earlier in this loop
                continue
            sampled: Sample | None = packed.get(seq.seq_id)
            if sampled is None:
                sampled = by_seq_id.get(seq.seq_id)
            if (sampled is not None and type(sampled) is not int and sampled.prompt_logprobs
                    and group.is_collecting_prompt_logprobs):
                group.prompt_logprobs.extend(sampled.prompt_logprobs)
                del group.prompt_logprobs[group.prompt_len - 1:]
            # not preempted by a step scheduled since, nor its blocks freed for its last token
            if is_caching and seq.status is SequenceStatus.RUNNING and bm.has_seq(seq.seq_id):
                bm.mark_computed(seq.seq_id, seq.token_ids, seq.num_computed_tokens)
            if not item.is_sampling:
                continue
            if group.pooling_type:
                self._finish_pooled(group, seq, pooled.get(seq.seq_id))
                continue
            error = _sample_count_error(item, sampled)
            if error is not None:
                self.scheduler.finish_group(group, FinishReason.ERROR, error)
                continue
            samples.setdefault(id(group), []).append((seq, sampled))
            drafts[seq.seq_id] = item.draft_token_ids
        self._take_samples(groups, samples, drafts, step_output)
        return list(groups.values())

    def _take_samples(self, groups: dict[int, SequenceGroup],
                      samples: dict[int, list[tuple[Sequence, Sample]]],
                      drafts: dict[int, list[int] | None], step_output: StepOutput) -> None:
        """Each group's samples into its sequences: beams, the first fork of n > 1, or a token
        (verified drafts too) a sequence."""
        now = time.monotonic()
        for key, sampled_seqs in samples.items():
            group = groups[key]
            if group.is_finished:
                continue
            if group.first_token_time is None:
                group.first_token_time = now
                self.num_prompt_tokens += group.prompt_len
            self.num_generation_tokens += len(sampled_seqs)  # one token per sequence, but:
            if group.is_beam_search:
                beam_search_step(
                    group, [(seq, _unpacked(step_output, seq, s)) for seq, s in sampled_seqs],
                    lambda seq, token_id, sampling=group.sampling: self._stop_reason(
                        sampling, seq, token_id),
                    self._fork, self.scheduler.free_seq)
            elif not group.has_forked and group.sampling.num_candidates > 1:
                seq, sampled = sampled_seqs[0]
                sampled = _unpacked(step_output, seq, sampled)
                self.num_generation_tokens += len(sampled.token_ids) - 1  # candidates
                self._fork_candidates(group, seq, sampled)
            else:
                sampling = group.sampling
                for seq, sampled in sampled_seqs:
                    if type(sampled) is int:
                        self._append_token(sampling, seq, step_output.sampled_token_ids[sampled],
                                           step_output.sampled_logprobs[sampled])
                        seq_drafts = drafts.get(seq.seq_id)
                        if seq_drafts is not None:  # a verification that accepted none
                            self._record_verified(seq, seq_drafts, 0, False)
                    else:
                        self._append_verified(group, seq, sampled, drafts.get(seq.seq_id))
            self.scheduler.free_finished(group)

    def _finish_pooled(self, group: SequenceGroup, seq: Sequence,
                       embedding: list[float] | None) -> None:
        """An embedding request ends with its prompt: no token is sampled."""
        if embedding is None:
            self.scheduler.finish_group(group, FinishReason.ERROR, (
                f"worker returned no embedding for seq_id {seq.seq_id}"))
            return
        group.embedding = embedding
        group.first_token_time = time.monotonic()
        self.num_prompt_tokens += group.prompt_len
        seq.finish(FinishReason.STOP)
        self.scheduler.free_finished(group)

    def report(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        return [r for g in groups if (r := make_request_output(g)) is not None]

    def _append(self, group: SequenceGroup, seq: Sequence, sampled: SampledSequence,
                i: int) -> None:
        top = sampled.top_logprobs[i] if i < len(sampled.top_logprobs) else None
        self._append_token(group.sampling, seq, sampled.token_ids[i], sampled.logprobs[i], top)

    def _append_token(self, sampling: SamplingParams, seq: Sequence, token_id: int,
                      logprob: float, top: list[TokenIdLogprob] | None = None) -> None:
        reason = self._stop_reason(sampling, seq, token_id)
        seq.append_token(token_id, logprob, top)
        if reason is not None:
            seq.finish(reason)

    def _append_verified(self, group: SequenceGroup, seq: Sequence, sampled: SampledSequence,
                         drafts: list[int] | None) -> None:
        """The accepted drafts and the next token, up to a stop; without drafts, the one token."""
        if drafts is None and len(sampled.token_ids) == 1:  # the usual decode
            self._append(group, seq, sampled, 0)
            return
        for i in range(len(sampled.token_ids)):
            self._append(group, seq, sampled, i)
            if seq.is_finished:
                break
        self.num_generation_tokens += i
        if drafts is not None:
            self._record_verified(seq, drafts, len(sampled.token_ids) - 1, sampled.is_draft_behind)

    def _record_verified(self, seq: Sequence, drafts: list[int], num_accepted: int,
                         is_draft_behind: bool) -> None:
        speculator = self.scheduler.speculator
        if speculator is None:
            return
        # a draft model too far behind proposed nothing: neither a miss nor a rejection
        speculator.record(seq, 0 if is_draft_behind else len(drafts), num_accepted,
                          is_draft_behind)
        # without drafts no slot is given back: a step sent behind this one may hold the next
        if drafts and not seq.is_finished:
            self.scheduler.keep_verified(seq, num_accepted)

    def _fork_candidates(self, group: SequenceGroup, parent: Sequence,
                         sampled: SampledSequence) -> None:
        children = [self._fork(group, parent) for _ in range(1, len(sampled.token_ids))]
        group.has_forked = True
        for i, seq in enumerate([parent, *children]):
            self._append(group, seq, sampled, i)

    def _fork(self, group: SequenceGroup, parent: Sequence) -> Sequence:
        index = max(s.index for s in group.seqs) + 1
        child = parent.fork(next(self._seq_ids), index, derive_seed(group.sampling.seed, index))
        self.scheduler.fork_seq(parent, child)
        group.seqs.append(child)
        return child

    def _stop_reason(self, sampling: SamplingParams, seq: Sequence,
                     token_id: int) -> FinishReason | None:
        num_output_tokens = seq.num_output_tokens + 1
        if num_output_tokens > sampling.min_tokens:
            if not sampling.ignore_eos and token_id in self.eos_token_ids:
                return FinishReason.STOP
            if token_id in sampling.stop_token_ids:
                return FinishReason.STOP
        if num_output_tokens >= sampling.max_tokens or len(seq.token_ids) + 1 >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _unpacked(step_output: StepOutput, seq: Sequence, sampled: Sample) -> SampledSequence:
    if type(sampled) is int:
        return SampledSequence(seq.seq_id, [step_output.sampled_token_ids[sampled]],
                               [step_output.sampled_logprobs[sampled]])
    return sampled


def _sample_count_error(item: ScheduledSequence, sampled: Sample | None) -> str | None:
    """A verification step returns 1 to k + 1 tokens for k drafts, any other exactly num_samples."""
    got = 0 if sampled is None else 1 if type(sampled) is int else len(sampled.token_ids)
    num_drafts = len(item.draft_token_ids or ())
    if (1 <= got <= num_drafts + 1) if num_drafts else got == item.num_samples:
        return None
    expected = f"1 to {num_drafts + 1}" if num_drafts else str(item.num_samples)
    return (f"worker returned {got} sampled tokens for seq_id {item.seq.seq_id}, "
            f"expected {expected}")
