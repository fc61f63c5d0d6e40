"""Speculative decoding, the scheduler's side: which decoding sequences get draft tokens this step
and how many (per sequence, from its recent acceptance), and the counters behind vLLM's
spec-decode metrics.

Proposals are made here, not in the worker: the n-gram proposer needs only token ids, which the
scheduler holds for every sequence, and the scheduler must know the draft count anyway to size
the step's token budget and the sequence's block table. So the step protocol carries k token ids
per sequence and the worker answers with the accepted ones plus the target's next token; no
vocabulary-sized data crosses it. With a draft model the worker proposes: the scheduler plans
the same k slots, as k placeholders, and the plan carries their number (num_lookahead_slots).

A step carrying drafts, or scheduling a sequence that is speculating, is not run ahead (the next
step waits for its tokens): how many tokens it appends is known only once verified, and drafts
are proposed from known tokens, never from a placeholder. A sequence whose speculation stopped
paying backs off: it proposes nothing and runs ahead like any other for a while, then tries again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.scheduler_svc.ngram_proposer import propose_ngram
from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence
from pagedserve.scheduler_svc.sequence import PLACEHOLDER_TOKEN_ID, Sequence, SequenceGroup
from pagedserve.services.common.speculative_config import SpeculativeConfig

# recent acceptance is an exponential average with this weight on the newest drafted step
_SMOOTHING = 0.25
_FIRST_ACCEPTED_PER_DRAFT_STEP = 2.0
# below this many kept drafts per drafted step, on average, the drafts cost more than they save
_MIN_ACCEPTED_PER_DRAFT_STEP = 0.5
# steps in a row without a match after which a sequence stops holding run-ahead back
_MAX_MISSES = 16
_FIRST_BACKOFF_STEPS = 8
_MAX_BACKOFF_STEPS = 256


@dataclass(slots=True)
class _Acceptance:
    """One sequence's recent record. Rejected drafts cost verification; steps without a match
    cost only run-ahead, so they back off later (a rewrite's preamble matches nothing before
    the copied text does)."""

    accepted_per_draft_step: float = _FIRST_ACCEPTED_PER_DRAFT_STEP
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

    def propose(self, group: SequenceGroup, seq: Sequence, max_tokens: int) -> list[int] | None:
        """Draft tokens (at most max_tokens) for a sequence that decodes this step; [] when none
        matched, None when it does not speculate this step (backed off, its last token still a
        placeholder, no room). A backed-off sequence counts down here, once per decoding step."""
        acceptance = self._acceptance.get(seq.seq_id)
        if acceptance is not None and acceptance.idle_steps:
            acceptance.idle_steps -= 1
            return None
        if not self.is_speculating(group, seq) or seq.has_placeholder:
            return None
        sampling = group.sampling
        num_tokens = min(self._lookahead(acceptance), max_tokens,
                         sampling.max_tokens - seq.num_output_tokens - 1,
                         self.max_model_len - len(seq.token_ids) - 1)
        if num_tokens < 1:
            return None
        if self.config.method == "draft_model":  # the worker's draft model fills them in
            return [PLACEHOLDER_TOKEN_ID] * num_tokens
        return propose_ngram(seq.token_ids, num_tokens, self.config.prompt_lookup_min,
                             self.config.prompt_lookup_max)

    def holds_back_run_ahead(self, scheduled: list[ScheduledSequence]) -> bool:
        return any(item.draft_token_ids or (item.is_sampling and self.is_speculating(
            item.group, item.seq)) for item in scheduled)

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a verified step (num_drafts = 0: it decoded without a proposal)."""
        if num_drafts:
            totals = self.totals
            totals.num_drafts += 1
            totals.num_draft_tokens += num_drafts
            totals.num_accepted_tokens += num_accepted
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
        """One past the recent accepted length: the drafts a step will likely keep, and one to
        grow by."""
        k = self.config.num_speculative_tokens
        if acceptance is None or not self.config.adaptive:
            return k
        return max(1, min(k, round(acceptance.accepted_per_draft_step) + 1))
