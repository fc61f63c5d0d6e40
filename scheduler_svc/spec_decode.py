"""Speculative decoding, the scheduler's side: which decoding sequences get draft tokens this step
and how many (per sequence, from its recent acceptance), and the counters behind vLLM's
spec-decode metrics.

Proposals are made here, not in the worker: the n-gram proposer needs only token ids, which the
scheduler holds for every sequence, and the scheduler must know the draft count anyway to size
the step's token budget and the sequence's block table. So the step protocol carries k token ids
per sequence and the worker answers with the accepted ones plus the target's next token; no
vocabulary-sized data crosses it. With a draft model the worker proposes: the scheduler plans
the same k slots, as k placeholders, and the plan carries their number (num_lookahead_slots).

Which drafts a step carries is a trade: a draft costs a token's share of the step (StepCostModel,
learned from the workers' timings) and is worth the chance it is kept (the sequence's recent
acceptance). drafts_that_pay keeps those that raise the step's expected tokens per second.

A step carrying drafts is not run ahead (the next step waits for its tokens): how many tokens it
appends is known only once verified. With n-gram lookup a step without drafts runs ahead as any
other (a draft model's step holds back for any speculating sequence: it drafts from known
tokens only); the step
sent behind it proposes past the token still being drawn, from the known tokens' match: its
first token guesses the one being drawn, the rest are the drafts (the verifier keeps only what
the model draws, so a wrong guess costs the drafts, never the outputs). A sequence whose
speculation stopped paying backs off: it proposes nothing for a while, then tries again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler_svc.ngram_proposer import propose_ngram
from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence
from pagedserve.scheduler_svc.sequence import PLACEHOLDER_TOKEN_ID, Sequence, SequenceGroup
from pagedserve.scheduler_svc.step_cost import StepCostModel
from pagedserve.services.common.speculative_config import SpeculativeConfig
from pagedserve.services.common.step_plan import StepTimings

# recent acceptance is an exponential average with this weight on the newest drafted step
_SMOOTHING = 0.25
_FIRST_ACCEPTED_PER_DRAFT_STEP = 2.0
# below this many kept drafts per drafted step, on average, the drafts cost more than they save
_MIN_ACCEPTED_PER_DRAFT_STEP = 0.5
# steps in a row without a match after which a sequence stops looking for a while
_MAX_MISSES = 16
_FIRST_BACKOFF_STEPS = 8
# a sequence's acceptance rate: the weight its older drafted steps keep per newer one, and the
# engine-wide prior's weight in drafted steps
_RATE_DECAY = 0.8
_PRIOR_STEPS = 2.0
_MAX_BACKOFF_STEPS = 256


@dataclass(slots=True)
class _Acceptance:
    """One sequence's recent record. Rejected drafts cost verification; steps without a match
    cost only run-ahead, so they back off later (a rewrite's preamble matches nothing before
    the copied text does)."""

    accepted_per_draft_step: float = _FIRST_ACCEPTED_PER_DRAFT_STEP
    # exponentially weighted counts of kept drafts and of drafted steps that rejected one
    num_accepted: float = 0.0
    num_rejected: float = 0.0
    num_misses: int = 0  # drafted nothing, steps in a row
    backoff_steps: int = _FIRST_BACKOFF_STEPS
    idle_steps: int = 0  # steps left without speculation


@dataclass(slots=True)
class SpecDecodeTotals:
    """Since start, as vLLM counts them."""

    num_drafts: int = 0  # steps of a sequence with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.totals = SpecDecodeTotals(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.step_cost = StepCostModel()
        self._num_rejections = 0  # drafted steps that rejected a draft, since start
        self._acceptance: dict[int, _Acceptance] = {}

    def is_speculating(self, group: SequenceGroup, seq: Sequence) -> bool:
        """Proposes for this sequence when it decodes: never for beam search (its beams are
        chosen from several samples each step), a sequence sampling several tokens, or one with
        structured outputs (a draft's rows would need the grammar advanced through the drafts
        before them)."""
        if (group.is_beam_search or group.num_samples() != 1
                or group.sampling.structured_outputs is not None):
            return False
        acceptance = self._acceptance.get(seq.seq_id)
        return acceptance is None or acceptance.idle_steps == 0

    def propose(self, group: SequenceGroup, seq: Sequence, max_tokens: int,
                num_running: int) -> list[int] | None:
        """Draft tokens (at most max_tokens) for a sequence that decodes this step; [] when none
        matched, None when it does not speculate this step (backed off, `num_running` requests
        reach disable_by_batch_size, no room). A backed-off sequence counts down here, once per
        decoding step. Past a placeholder, the match's first token guesses it."""
        acceptance = self._acceptance.get(seq.seq_id)
        if acceptance is not None and acceptance.idle_steps:
            acceptance.idle_steps -= 1
            return None
        limit = self.config.disable_by_batch_size
        if not self.is_speculating(group, seq) or (limit and num_running >= limit):
            return None
        num_tokens = min(self.config.num_speculative_tokens, max_tokens,
                         group.sampling.max_tokens - seq.num_output_tokens - 1,
                         self.max_model_len - len(seq.token_ids) - 1)
        if num_tokens < 1:
            return None
        config = self.config
        if config.method == "draft_model":  # the worker's draft model fills them in
            if seq.has_placeholder:
                return None
            return [PLACEHOLDER_TOKEN_ID] * min(num_tokens, self._lookahead(acceptance))
        if not seq.has_placeholder:
            return propose_ngram(seq.token_ids, num_tokens, config.prompt_lookup_min,
                                 config.prompt_lookup_max)
        return propose_ngram(seq.token_ids[:-1], num_tokens + 1, config.prompt_lookup_min,
                             config.prompt_lookup_max)[1:]

    def drafts_that_pay(self, scheduled: list[ScheduledSequence]) -> list[int]:
        """How many of its drafts each scheduled sequence keeps: the drafts, most likely kept
        first, that raise the step's expected tokens per second. With the step's time
        fixed + per_token * n and y tokens expected, one more draft kept with probability p
        pays when (y + p) / (t + per_token) > y / t, i.e. p * t > per_token * y. A draft is kept
        when every one before it is, with the sequence's recent per-draft rate each; a guess
        past a placeholder is one more draft to get right."""
        counts = [len(item.draft_token_ids or ()) for item in scheduled]
        if not self.config.adaptive or self.config.method != "ngram" or not any(counts):
            return counts
        fixed_s, per_token_s = self.step_cost.line()
        if not per_token_s:
            return counts
        candidates = []
        for i, item in enumerate(scheduled):
            rate = self._acceptance_rate(item.seq.seq_id)
            first = 2 if item.seq.has_placeholder else 1
            candidates += [(rate ** (first + j), j, i) for j in range(counts[i])]
        candidates.sort(key=lambda c: (-c[0], c[1]))
        kept = [0] * len(scheduled)
        num_expected = float(sum(item.is_sampling for item in scheduled))
        time_s = fixed_s + per_token_s * sum(item.num_known_tokens for item in scheduled)
        for p, _, i in candidates:
            if p * time_s <= per_token_s * num_expected:
                break
            kept[i] += 1
            num_expected += p
            time_s += per_token_s
        return kept

    def record_step(self, scheduled: list[ScheduledSequence], timings: StepTimings) -> None:
        """A finished step's worker time, for the cost of a token; decode steps only."""
        if not all(item.is_sampling and item.num_known_tokens == 1 for item in scheduled):
            return
        num_tokens = sum(item.num_scheduled_tokens for item in scheduled)
        time_ns = timings.prepare_ns + timings.forward_ns + timings.sample_ns
        if num_tokens and time_ns:
            self.step_cost.record(num_tokens, time_ns * 1e-9)

    def holds_back_run_ahead(self, scheduled: list[ScheduledSequence]) -> bool:
        """A draft model proposes from known tokens only: there a speculating sequence holds
        run-ahead back too."""
        if self.config.method == "ngram":
            return any(item.draft_token_ids for item in scheduled)
        return any(item.draft_token_ids or (item.is_sampling and self.is_speculating(
            item.group, item.seq)) for item in scheduled)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a verified step (num_drafts = 0: it decoded without a proposal)."""
        if num_drafts:
            totals = self.totals
            totals.num_drafts += 1
            totals.num_draft_tokens += num_drafts
            totals.num_accepted_tokens += num_accepted
            self._num_rejections += num_accepted < num_drafts
            for pos in range(num_accepted):
                totals.num_accepted_tokens_per_pos[pos] += 1
        if not self.config.adaptive:
            return
        acceptance = self._acceptance.setdefault(seq.seq_id, _Acceptance())
        if not num_drafts:
            acceptance.num_misses += 1
            if acceptance.num_misses >= _MAX_MISSES:
                self._back_off(acceptance)
            return
        acceptance.num_misses = 0
        acceptance.num_accepted = _RATE_DECAY * acceptance.num_accepted + num_accepted
        acceptance.num_rejected = (_RATE_DECAY * acceptance.num_rejected
                                   + (num_accepted < num_drafts))
        acceptance.accepted_per_draft_step += _SMOOTHING * (
            num_accepted - acceptance.accepted_per_draft_step)
        if acceptance.accepted_per_draft_step < _MIN_ACCEPTED_PER_DRAFT_STEP:
            self._back_off(acceptance)
        elif num_accepted:
            acceptance.backoff_steps = _FIRST_BACKOFF_STEPS

    @staticmethod
    def _back_off(acceptance: _Acceptance) -> None:
        """Idle for a while, twice as long as last time, then a fresh chance."""
        acceptance.idle_steps = acceptance.backoff_steps
        acceptance.backoff_steps = min(2 * acceptance.backoff_steps, _MAX_BACKOFF_STEPS)
        acceptance.accepted_per_draft_step = _FIRST_ACCEPTED_PER_DRAFT_STEP
        acceptance.num_misses = 0

    def forget(self, seq_id: int) -> None:
        self._acceptance.pop(seq_id, None)

    def _lookahead(self, acceptance: _Acceptance | None) -> int:
        """A draft model's: one past the recent accepted length."""
        k = self.config.num_speculative_tokens
        if acceptance is None or not self.config.adaptive:
            return k
        return max(1, min(k, round(acceptance.accepted_per_draft_step) + 1))

    def _acceptance_rate(self, seq_id: int) -> float:
        """The chance a draft is kept given the ones before it were: kept drafts over kept ones
        plus rejections (a geometric run), the sequence's recent record on top of a prior of
        _PRIOR_STEPS drafted steps at the engine's rate so far (optimistic before any record,
        so that drafts are tried and their rate learned)."""
        totals = self.totals
        prior = (totals.num_accepted_tokens + 4) / (
            totals.num_accepted_tokens + self._num_rejections + 5)
        acceptance = self._acceptance.get(seq_id)
        if acceptance is None:
            return prior
        accepted = acceptance.num_accepted + _PRIOR_STEPS * prior
        return accepted / (accepted + acceptance.num_rejected + _PRIOR_STEPS * (1 - prior))
