"""Speculative decoding, the scheduler's side: which decoding sequences get draft tokens this step
and how many (per sequence, from its recent acceptance), and the counters behind vLLM's
spec-decode metrics.

Proposals are made here, not in the worker: the n-gram proposer needs only token ids, which the
scheduler holds for every sequence, and the scheduler must know the draft count anyway to size
the step's token budget and the sequence's block table. So the step protocol carries k token ids
per sequence and the worker answers with the accepted ones plus the target's next token; no
vocabulary-sized data crosses it. With a draft model the worker proposes: the scheduler plans
the same k slots, as k placeholders, and the plan carries their number (num_lookahead_slots).

Which drafts a step carries is a trade: a draft costs a token's share of the target's step and,
with a draft model, a share of the draft positions' forwards (two StepCostModel lines, learned
from the workers' timings), and is worth the chance it is kept (the sequence's recent
acceptance). drafts_that_pay keeps those that give the step the most expected tokens per second,
none at all where speculation does not pay (draft_choice.py).

A step carrying drafts is not run ahead (the next step waits for its tokens): how many tokens it
appends is known only once verified. With n-gram lookup a step without drafts runs ahead as any
other; the step sent behind it proposes past the token still being drawn, from the known tokens'
match: its first token guesses the one being drawn, the rest are the drafts (the verifier keeps
only what the model draws, so a wrong guess costs the drafts, never the outputs). A draft model
drafts from known tokens only: a step without drafts holds run-ahead back only where its
sequences' drafts would pay. A sequence whose speculation stopped paying backs off: it proposes
nothing for a while, then tries again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler_svc.draft_catch_up import DraftCatchUp
from pagedserve.scheduler_svc.draft_choice import StepCosts, choose_drafts
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
# while a draft model's drafts do not pay, the choice is asked again every this many steps: the
# costs and the batch change slowly, and asking costs the host time it weighs
_REASK_STEPS = 8


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
class _Retry:
    """Steps without speculation before the next trial, twice as many after each."""

    num_steps_left: int = _FIRST_BACKOFF_STEPS * 2
    interval: int = _FIRST_BACKOFF_STEPS * 2

    def is_due(self) -> bool:
        self.num_steps_left -= 1
        if self.num_steps_left > 0:
            return False
        self.interval = min(2 * self.interval, _MAX_BACKOFF_STEPS)
        self.num_steps_left = self.interval
        return True


@dataclass(slots=True)
class SpecDecodeTotals:
    """Since start, as vLLM counts them."""

    num_drafts: int = 0  # steps of a sequence with drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 runs_ahead: bool = True) -> None:
        """runs_ahead: whether a step without drafts may be sent behind the one in flight."""
        self.config = config
        self.runs_ahead = runs_ahead
        self.max_model_len = max_model_len
        self.totals = SpecDecodeTotals(
            num_accepted_tokens_per_pos=[0] * config.num_speculative_tokens)
        self.step_cost = StepCostModel()
        self.draft_cost = StepCostModel()  # a draft position's, in its drafting sequences
        # the host's time per step outside the worker, and the worker's (prepare and sample),
        # in the step's sequences
        self.host_cost = StepCostModel()
        self.worker_host_cost = StepCostModel()
        self._last_step_s = 0.0  # the worker's time in the last step, of any kind
        # a draft model's speculation the choice turned off is tried again now and then: what
        # it learned of the acceptance and the costs may have changed
        self._retry = _Retry()
        self._is_trial = False  # the next step's drafts are kept whatever the choice says
        self._num_steps_off = 0  # steps run ahead since the choice last said drafts pay
        self._num_rejections = 0  # drafted steps that rejected a draft, since start
        self._acceptance: dict[int, _Acceptance] = {}
        self._catch_up = DraftCatchUp()

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
            return [PLACEHOLDER_TOKEN_ID] * num_tokens  # the step's choice cuts them
        lookup = (config.prompt_lookup_min, config.prompt_lookup_max,
                  config.prompt_lookup_max_spec_factor)
        if not seq.has_placeholder:
            return propose_ngram(seq.token_ids, num_tokens, *lookup)
        return propose_ngram(seq.token_ids[:-1], num_tokens + 1, *lookup)[1:]

    def drafts_that_pay(self, scheduled: list[ScheduledSequence]) -> list[int]:
        """How many of its drafts each scheduled sequence keeps: those that raise the step's
        expected tokens per second, the draft model's positions counted (draft_choice.py). A
        draft is kept when every one before it is, with the sequence's recent per-draft rate
        each; a guess past a placeholder is one more draft to get right."""
        counts = [len(item.draft_token_ids or ()) for item in scheduled]
        if not self.config.adaptive or not any(counts):
            return counts
        # one draft each: the acceptance, or a draft model's cost before any was timed, is
        # learned at the least cost (a draft model's where it owes the least catch-up)
        if self._is_trial or (self.config.method != "ngram" and not self.draft_cost.has_records):
            self._is_trial = False
            if self.config.method == "ngram":
                return [min(count, 1) for count in counts]
            return self._catch_up.trial([item.seq for item in scheduled], counts)
        kept = self._choose(scheduled, counts)
        if any(kept):
            self._retry = _Retry()
        return kept

    def _choose(self, scheduled: list[ScheduledSequence], counts: list[int],
                is_kept: list[int] | None = None) -> list[int]:
        """is_kept: the sequences whose drafts are taken to be all kept, the others' none."""
        fixed_s, per_token_s = self.step_cost.line()
        if not fixed_s and not per_token_s:  # no decode step timed yet: tokens are free
            fixed_s = self._last_step_s
        if not fixed_s:
            return counts
        host_s = worker_host_s = 0.0
        if self.config.method != "ngram":
            host_s, worker_host_s = (_at(line, len(scheduled))
                                     for line in (self.host_cost, self.worker_host_cost))
        costs = StepCosts(fixed_s, per_token_s, *self.draft_cost.line(), host_s=host_s,
                          worker_host_s=worker_host_s, runs_ahead=self.runs_ahead)
        # a draft model's drafts for a sequence the step's catch-up does not reach are none
        reached = (self._catch_up.reached([item.seq for item in scheduled])
                   if self.config.method != "ngram" else [True] * len(scheduled))
        rates = []
        for i, (item, count) in enumerate(zip(scheduled, counts, strict=True)):
            if is_kept is not None:
                rates.append([1.0] * count if is_kept[i] else [])
            elif not reached[i]:
                rates.append([])
            else:
                rate = self._acceptance_rate(item.seq.seq_id)
                # n-gram lookup past a placeholder guesses it first (a draft model waits for it)
                first = 2 if item.seq.has_placeholder and self.config.method == "ngram" else 1
                rates.append([rate ** (first + j) for j in range(count)])
        num_known_tokens = sum(item.num_known_tokens for item in scheduled)
        # a draft model's steps hold run-ahead back: a step made longer by drafts delays the
        # prompt chunks in it too, and with them the requests that would join the batch
        num_expected = (num_known_tokens if self.config.method != "ngram"
                        else sum(item.is_sampling for item in scheduled))
        return choose_drafts(rates, num_known_tokens, float(num_expected), costs)

    def record_step(self, scheduled: list[ScheduledSequence], timings: StepTimings,
                    host_s: float | None = None) -> None:
        """A finished step's worker time: a decode step's for the cost of a token; any step's
        draft model time for the cost of a draft position (a prompt chunk's catch-up makes it
        dearer, so that the choice errs towards no speculation). host_s: the rest of its
        period, where it was sent after the step before finished."""
        time_ns = timings.prepare_ns + timings.forward_ns + timings.sample_ns
        self._last_step_s = time_ns * 1e-9
        if host_s is not None:
            self.host_cost.record(len(scheduled), host_s)
        num_positions = max((len(item.draft_token_ids or ()) for item in scheduled), default=0)
        if timings.draft_ns and num_positions:
            num_drafts = sum(len(item.draft_token_ids or ()) for item in scheduled)
            self.draft_cost.record(num_drafts / num_positions,
                                   timings.draft_ns * 1e-9 / num_positions)
        if not all(item.is_sampling and item.num_known_tokens == 1 for item in scheduled):
            return
        num_tokens = sum(item.num_scheduled_tokens for item in scheduled)
        if num_tokens and time_ns:
            self.step_cost.record(num_tokens, time_ns * 1e-9)
            self.worker_host_cost.record(len(scheduled),
                                         (timings.prepare_ns + timings.sample_ns) * 1e-9)

    def holds_back_run_ahead(self, scheduled: list[ScheduledSequence], num_running: int) -> bool:
        """A step with drafts holds run-ahead back (the next step needs its verified tokens).
        With a draft model, which proposes from known tokens only, so does a step whose
        sequences would speculate if it did not run ahead: one whose drafts would pay."""
        if any(item.draft_token_ids for item in scheduled):
            return True
        limit = self.config.disable_by_batch_size
        if self.config.method == "ngram" or (limit and num_running >= limit):
            return False
        counts = [self.config.num_speculative_tokens
                  if item.is_sampling and self.is_speculating(item.group, item.seq) else 0
                  for item in scheduled]
        if not any(counts):
            return False
        if not self.config.adaptive:
            return True
        if self._num_steps_off % _REASK_STEPS == 0 and any(self._choose(scheduled, counts)):
            self._num_steps_off = 0
            return True
        self._num_steps_off += 1
        self._is_trial = self._retry.is_due() and self._trial_could_pay(scheduled, counts)
        return self._is_trial

    def _trial_could_pay(self, scheduled: list[ScheduledSequence], counts: list[int]) -> bool:
        """Whether the sequences a trial would draft for pay with every draft kept: where they
        do not (one sequence of a large batch that has drifted behind), what the trial would
        learn cannot turn speculation on, and its two steps held back cost the whole batch."""
        trial = self._catch_up.trial([item.seq for item in scheduled], counts)
        return any(self._choose(scheduled, counts, is_kept=trial))

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int,
               is_draft_behind: bool = False) -> None:
        """After a verified step (num_drafts = 0: it decoded without a proposal);
        is_draft_behind: a draft model's catch-up did not reach it."""
        if is_draft_behind:
            self._catch_up.behind(seq)
        elif num_drafts and self.config.method != "ngram":
            self._catch_up.proposed(seq)
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
        if not num_drafts and self.config.method != "ngram":
            return  # a draft model always proposes: the step's choice cut its drafts
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
        self._catch_up.forget(seq_id)

    def preempted(self, seq: Sequence) -> None:
        """Its draft KV may be gone (a recompute) or moved (a swap): owed again from the start."""
        self._catch_up.forget(seq.seq_id)

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


def _at(line: StepCostModel, num_seqs: int) -> float:
    fixed_s, per_seq_s = line.line()
    return fixed_s + per_seq_s * num_seqs
