"""The worker's mirror of the scheduler's sequences, kept up to date from StepPlan deltas (vLLM
V1's persistent batch). The scheduler is the truth."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from pagedserve.services.common.cdiv import cdiv
from pagedserve.services.common.errors import InvalidRequest, NotFound
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import (
    POOLING_TYPES,
    NewSequence,
    RunningSequence,
    SampledSequence,
    StepPlan,
)
from pagedserve.worker_svc.block_table_rows import BlockTableRows
from pagedserve.worker_svc.draft_blocks import DraftBlocks


@dataclass(slots=True)
class CachedSequence:
    seq_id: int
    request_id: str
    token_ids: list[int]  # prompt + outputs known to the worker
    prompt_len: int
    block_table: list[int]
    num_computed_tokens: int  # tokens whose KV is in the cache
    sampling: SamplingParams
    seed: int | None
    num_samples: int
    num_scheduled_tokens: int = 0  # this step's tokens, from num_computed_tokens on
    pooling_type: str = ""  # "last" or "mean": an embedding request, pooled and never sampled
    pooled_sum: Any = None  # mean pooling: the float32 sum of the hidden states so far [hidden]
    # this step's speculative tokens after token_ids (in num_scheduled_tokens), to verify
    draft_token_ids: list[int] = field(default_factory=list)
    num_lookahead_slots: int = 0  # this step's drafts the draft model proposes into draft_token_ids
    # the draft model's distributions its sampled drafts were drawn from; None: drafts to match
    draft_probs: torch.Tensor | None = None  # [len(draft_token_ids), vocab_size]
    num_draft_computed: int = 0  # tokens whose draft-model KV is in the cache
    block_row: int = -1  # block_table's row in the mirrors' BlockTableRows; -1: none

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def is_prefill(self) -> bool:
        return self.num_scheduled_tokens > 1

    @property
    def is_prompt_done(self) -> bool:
        """This step computes up to the last known token."""
        return self.num_computed_tokens + self.num_scheduled_tokens >= len(self.token_ids)

    @property
    def is_sampling(self) -> bool:
        return not self.pooling_type and self.is_prompt_done

    @property
    def wants_prompt_logprobs(self) -> bool:
        return (self.sampling.prompt_logprobs is not None
                and self.num_computed_tokens < self.prompt_len - 1)


class SequenceMirrors:
    def __init__(self, block_size: int, max_model_len: int) -> None:
        self.block_size = block_size
        self.max_model_len = max_model_len
        # the draft model's blocks; None: no draft model (num_lookahead_slots are refused)
        self.draft_blocks: DraftBlocks | None = None
        self.seqs: dict[int, CachedSequence] = {}
        self.block_rows = BlockTableRows(cdiv(max_model_len, block_size))
        # seq_id → its tokens drawn on the device but not appended yet (1, or 2 while a step
        # is launched ahead of the one before, whose draw it reads there)
        self.drawing: dict[int, int] = {}

    @property
    def has_draft_model(self) -> bool:
        return self.draft_blocks is not None

    def __len__(self) -> int:
        return len(self.seqs)

    def clear(self) -> None:
        self.seqs.clear()
        self.drawing.clear()
        self.block_rows.clear()

    def apply(self, plan: StepPlan, is_checked: bool = False) -> list[CachedSequence]:
        """All or none (is_checked: check() passed already). Returns this step's sequences,
        prefills first."""
        if not is_checked:
            self.check(plan)
        for seq_id in itertools.chain(plan.finished_seq_ids, plan.preempted_seq_ids):
            seq = self.seqs.pop(seq_id, None)
            if seq is not None:
                self.block_rows.release(seq.block_row)
            self.drawing.pop(seq_id, None)
        prefills: list[CachedSequence] = []
        others: list[CachedSequence] = []
        for seq in itertools.chain(map(self._add, plan.new_seqs),
                                   map(self._update, plan.running_seqs)):
            (prefills if seq.is_prefill else others).append(seq)
        seqs = self.seqs
        for seq_id, start in zip(plan.decode_seq_ids, plan.decode_block_ids_start, strict=True):
            seq = seqs[seq_id]  # _update of a plain decode's RunningSequence, field by field
            del seq.block_table[start:]
            seq.num_scheduled_tokens = seq.num_samples = 1
            if seq.draft_token_ids or seq.num_lookahead_slots:
                seq.draft_token_ids = []
                seq.num_lookahead_slots = 0
            seq.draft_probs = None
            others.append(seq)
        return prefills + others

    def check(self, plan: StepPlan, num_gpu_blocks: int | None = None,
              vocab_size: int | None = None) -> None:
        """Refuse deltas that cannot apply, touching nothing."""
        dropped = set(plan.finished_seq_ids) | set(plan.preempted_seq_ids)
        seq_ids = ([s.seq_id for s in plan.new_seqs] + [s.seq_id for s in plan.running_seqs]
                   + plan.decode_seq_ids)
        if len(set(seq_ids)) != len(seq_ids):
            raise InvalidRequest(f"a step names each sequence once, got seq_ids {seq_ids}")
        if len(plan.decode_seq_ids) != len(plan.decode_block_ids_start):
            raise InvalidRequest(
                f"decode_block_ids_start must have one entry per decode_seq_ids entry, got "
                f"{len(plan.decode_block_ids_start)} for {len(plan.decode_seq_ids)}")
        for new in plan.new_seqs:
            _check_ids("block_ids", new.seq_id, new.block_ids, num_gpu_blocks)
            _check_ids("token_ids", new.seq_id, new.token_ids, vocab_size)
            sampling = new.sampling
            _check_ids("stop_token_ids", new.seq_id, sampling.stop_token_ids, vocab_size)
            if sampling.has_token_constraints:
                _check_ids("logit_bias", new.seq_id, [t for t, _ in sampling.logit_bias],
                           vocab_size)
                _check_ids("allowed_token_ids", new.seq_id, sampling.allowed_token_ids or (),
                           vocab_size)
                _check_ids("bad_words_token_ids", new.seq_id,
                           [t for ids in sampling.bad_words_token_ids for t in ids], vocab_size)
            _check_pooling(new)
            self._check_lookahead(new.seq_id, new.draft_token_ids, new.num_lookahead_slots)
            _check_drafts(new.seq_id, new.draft_token_ids, new.num_lookahead_slots,
                          new.num_samples, sampling, vocab_size, len(new.token_ids),
                          new.num_computed_tokens + new.num_scheduled_tokens)
            self._check_lengths(new.seq_id, len(new.token_ids) + len(new.draft_token_ids)
                                + new.num_lookahead_slots,
                                len(new.block_ids), new.num_computed_tokens,
                                new.num_scheduled_tokens, new.prompt_len, new.num_samples)
        for delta in plan.running_seqs:
            seq = None if delta.seq_id in dropped else self.seqs.get(delta.seq_id)
            if seq is None:
                raise NotFound(f"seq_id {delta.seq_id} is not known to the worker; send it as a "
                               "new sequence")
            if not 0 <= delta.block_ids_start <= len(seq.block_table):
                raise InvalidRequest(f"seq {delta.seq_id}: block_ids_start="
                                     f"{delta.block_ids_start} outside [0, {len(seq.block_table)}]")
            # a plain decode sends no ids: its checks are skipped, not called with empty lists
            if delta.block_ids:
                _check_ids("block_ids", delta.seq_id, delta.block_ids, num_gpu_blocks)
            num_drawing = self.drawing.get(delta.seq_id, 0)
            if delta.new_token_ids or delta.draft_token_ids or delta.num_lookahead_slots:
                self._check_appended(seq, delta, num_drawing, vocab_size)
            self._check_lengths(delta.seq_id,
                                len(seq.token_ids) + num_drawing + len(delta.new_token_ids)
                                + len(delta.draft_token_ids) + delta.num_lookahead_slots,
                                delta.block_ids_start + len(delta.block_ids),
                                seq.num_computed_tokens, delta.num_scheduled_tokens,
                                seq.prompt_len, delta.num_samples)
        self._check_decodes(plan, dropped)

    def _check_decodes(self, plan: StepPlan, dropped: set[int]) -> None:
        """The packed plain decodes: _check_lengths' rules for one token and one sample, in one
        comparison each while they hold."""
        seqs, drawing, block_size = self.seqs, self.drawing, self.block_size
        for seq_id, start in zip(plan.decode_seq_ids, plan.decode_block_ids_start, strict=True):
            seq = None if seq_id in dropped else seqs.get(seq_id)
            if seq is None:
                raise NotFound(f"seq_id {seq_id} is not known to the worker; send it as a new "
                               "sequence")
            num_tokens = len(seq.token_ids) + drawing.get(seq_id, 0)
            end = seq.num_computed_tokens + 1
            if not (0 <= start <= len(seq.block_table) and end <= num_tokens
                    and end <= min(self.max_model_len, start * block_size)):
                if not 0 <= start <= len(seq.block_table):
                    raise InvalidRequest(f"seq {seq_id}: block_ids_start={start} outside "
                                         f"[0, {len(seq.block_table)}]")
                self._check_lengths(seq_id, num_tokens, start, seq.num_computed_tokens, 1,
                                    seq.prompt_len, 1)

    def _check_appended(self, seq: CachedSequence, delta: RunningSequence, num_drawing: int,
                        vocab_size: int | None) -> None:
        """A delta's new tokens and drafts: valid ids, after no token still being drawn."""
        _check_ids("new_token_ids", delta.seq_id, delta.new_token_ids, vocab_size)
        if num_drawing:
            raise InvalidRequest(f"seq {delta.seq_id}: new_token_ids={delta.new_token_ids}, "
                                 f"draft_token_ids={delta.draft_token_ids} or "
                                 f"num_lookahead_slots={delta.num_lookahead_slots} would "
                                 "follow a token the worker has not drawn yet")
        self._check_lookahead(delta.seq_id, delta.draft_token_ids, delta.num_lookahead_slots)
        _check_drafts(delta.seq_id, delta.draft_token_ids, delta.num_lookahead_slots,
                      delta.num_samples, seq.sampling, vocab_size,
                      len(seq.token_ids) + len(delta.new_token_ids),
                      seq.num_computed_tokens + delta.num_scheduled_tokens)

    def mark_computed(self, scheduled: list[CachedSequence]) -> None:
        """The step is launched: its tokens' KV is (in device order) in the cache, and the
        sequences that sample one token are drawing it."""
        for seq in scheduled:
            if seq.draft_token_ids:  # computed up to its last known token; the rest at finish
                seq.num_computed_tokens += seq.num_scheduled_tokens - len(seq.draft_token_ids)
                seq.num_scheduled_tokens = 0
                continue
            if seq.num_samples == 1 and seq.is_sampling:
                self.drawing[seq.seq_id] = self.drawing.get(seq.seq_id, 0) + 1
            seq.num_computed_tokens += seq.num_scheduled_tokens
            seq.num_scheduled_tokens = 0

    def append_drawn(self, scheduled: list[CachedSequence], sampled: list[SampledSequence],
                     single_seq_ids: Sequence[int] = (),
                     single_token_ids: Sequence[int] = ()) -> None:
        """A sequence that sampled exactly one token has it appended: the scheduler counts on
        it. Several samples (forks, beams) wait for the scheduler's choice. A sequence dropped
        or sent whole again since the step was launched keeps what the scheduler sent.
        single_*: single samples, packed (StepOutput's), of sequences without drafts."""
        launched = {seq.seq_id: seq for seq in scheduled}
        for seq_id, token_id in zip(single_seq_ids, single_token_ids, strict=True):
            self._append_one(launched.get(seq_id), token_id)
        for out in sampled:
            seq_id = out.seq_id
            seq = launched.get(seq_id)
            if seq is not None and seq.draft_token_ids:
                if self.seqs.get(seq_id) is seq:  # the accepted drafts' KV is computed
                    num_known = len(seq.token_ids)
                    seq.token_ids.extend(out.token_ids)
                    seq.num_computed_tokens += len(out.token_ids) - 1
                    # the draft model's KV past them holds rejected drafts
                    seq.num_draft_computed = min(seq.num_draft_computed, seq.num_computed_tokens)
                    if self.draft_blocks is not None:
                        self.draft_blocks.mark(seq.block_table, num_known,
                                               seq.num_draft_computed)
                seq.draft_token_ids = []
                seq.draft_probs = None
                continue
            if len(out.token_ids) == 1:
                self._append_one(seq, out.token_ids[0])

    def _append_one(self, seq: CachedSequence | None, token_id: int) -> None:
        """`seq`'s one drawn token, if it is still the mirror's and was drawing it."""
        if seq is None or self.seqs.get(seq.seq_id) is not seq:
            return
        num_drawing = self.drawing.get(seq.seq_id, 0)
        if num_drawing > 1:
            self.drawing[seq.seq_id] = num_drawing - 1
        elif num_drawing:
            del self.drawing[seq.seq_id]
        else:
            return
        seq.token_ids.append(token_id)

    def _add(self, new: NewSequence) -> CachedSequence:
        # a sequence sent whole replaces whatever the worker knew of it
        self.drawing.pop(new.seq_id, None)
        known = self.seqs.get(new.seq_id)
        row = known.block_row if known is not None else self.block_rows.take()
        self.block_rows.write(row, 0, new.block_ids)
        seq = CachedSequence(
            seq_id=new.seq_id, request_id=new.request_id, token_ids=list(new.token_ids),
            prompt_len=new.prompt_len, block_table=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens, sampling=new.sampling, seed=new.seed,
            num_samples=new.num_samples, num_scheduled_tokens=new.num_scheduled_tokens,
            pooling_type=new.pooling_type, draft_token_ids=list(new.draft_token_ids),
            num_lookahead_slots=new.num_lookahead_slots,
            # where its full blocks hold the draft model's KV (swaps, copy-on-write and the prefix
            # cache move every layer); past them, its tokens may have passed the draft model by
            num_draft_computed=0 if self.draft_blocks is None else
            self.draft_blocks.num_valid_tokens(new.block_ids, new.num_computed_tokens),
            block_row=row)
        self.seqs[new.seq_id] = seq
        return seq

    def _update(self, delta: RunningSequence) -> CachedSequence:
        seq = self.seqs[delta.seq_id]
        seq.token_ids.extend(delta.new_token_ids)
        seq.block_table[delta.block_ids_start:] = delta.block_ids
        if delta.block_ids:
            self.block_rows.write(seq.block_row, delta.block_ids_start, delta.block_ids)
        seq.num_scheduled_tokens = delta.num_scheduled_tokens
        seq.num_samples = delta.num_samples
        seq.draft_token_ids = list(delta.draft_token_ids)
        seq.draft_probs = None
        seq.num_lookahead_slots = delta.num_lookahead_slots
        return seq

    def _check_lookahead(self, seq_id: int, drafts: list[int], num_lookahead_slots: int) -> None:
        if num_lookahead_slots and (drafts or not self.has_draft_model):
            raise InvalidRequest(f"seq {seq_id}: num_lookahead_slots={num_lookahead_slots} needs "
                                 "a worker with a draft model (speculative_config method "
                                 "'draft_model') and no draft_token_ids, got draft_token_ids="
                                 f"{drafts}")

    def _check_lengths(self, seq_id: int, num_tokens: int, num_blocks: int,
                       num_computed_tokens: int, num_scheduled_tokens: int, prompt_len: int,
                       num_samples: int) -> None:
        end = num_computed_tokens + num_scheduled_tokens
        if num_scheduled_tokens < 1 or num_computed_tokens < 0 or end > num_tokens:
            raise InvalidRequest(
                f"seq {seq_id}: num_scheduled_tokens={num_scheduled_tokens} from "
                f"num_computed_tokens={num_computed_tokens} must be >= 1 and stay within "
                f"its {num_tokens} tokens")
        if end > self.max_model_len:
            raise InvalidRequest(f"seq {seq_id}: {end} tokens exceed max_model_len="
                                 f"{self.max_model_len}")
        if num_blocks * self.block_size < end:
            raise InvalidRequest(f"seq {seq_id}: block table of {num_blocks} blocks "
                                 f"cannot hold {end} tokens (block_size {self.block_size})")
        if not 0 <= prompt_len <= num_tokens:
            raise InvalidRequest(f"seq {seq_id}: prompt_len={prompt_len} outside "
                                 f"[0, {num_tokens}]")
        if num_samples < 1:
            raise InvalidRequest(f"seq {seq_id}: num_samples must be >= 1, got {num_samples}")


def _check_pooling(new: NewSequence) -> None:
    if new.pooling_type not in POOLING_TYPES:
        raise InvalidRequest(f"seq {new.seq_id}: pooling_type must be one of "
                             f"{list(POOLING_TYPES)}, got {new.pooling_type!r}")
    if new.pooling_type == "mean" and new.num_computed_tokens:
        raise InvalidRequest(f"seq {new.seq_id}: mean pooling needs every prompt token's hidden "
                             f"state, got num_computed_tokens={new.num_computed_tokens}")


def _check_drafts(seq_id: int, drafts: list[int], num_lookahead_slots: int, num_samples: int,
                  sampling: SamplingParams, vocab_size: int | None, num_known: int,
                  end: int) -> None:
    """Drafts follow every known token and are all computed in the step that verifies them."""
    if not drafts and not num_lookahead_slots:
        return
    _check_ids("draft_token_ids", seq_id, drafts, vocab_size)
    num_drafts = len(drafts) + num_lookahead_slots
    if num_samples != 1 or sampling.use_beam_search:
        raise InvalidRequest(f"seq {seq_id}: drafts need num_samples=1 and no beam "
                             f"search, got num_samples={num_samples}")
    if sampling.structured_outputs is not None:
        raise InvalidRequest(f"seq {seq_id}: drafts are not verified under "
                             f"structured_outputs")
    if end != num_known + num_drafts:
        raise InvalidRequest(f"seq {seq_id}: its {num_drafts} drafts must end the step's tokens: "
                             f"the step computes up to {end}, its known tokens and drafts end "
                             f"at {num_known + num_drafts}")


def _check_ids(name: str, seq_id: int, ids: list[int] | tuple[int, ...], limit: int | None) -> None:
    if limit is None:
        return
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        raise InvalidRequest(f"seq {seq_id}: {name} must be in [0, {limit}), got {bad[:8]}")
