"""What a draft model still owes each sequence, as the scheduler sees it: the tokens whose draft KV
the worker has not computed. The worker catches them up before the sequence proposes, at most
MAX_CATCH_UP_TOKENS a step, the least behind first, and a sequence not caught up by then proposes
nothing that step (worker_svc/draft_proposer.py). So the choice of drafts counts it: drafts for a
sequence the step's catch-up does not reach are worth nothing to the step, and a trial drafts
where it owes the least.

The draft model computes a sequence's tokens only in a step where it proposes, so what it owes is
the tokens since it last proposed (all of them before its first proposal). Draft KV that a
prefix-cache hit or a swap-in brings along is not seen here: the estimate errs towards owing
more, i.e. towards no speculation.
"""

from __future__ import annotations

from pagedserve.scheduler_svc.sequence import Sequence
from pagedserve.services.common.speculative_config import MAX_CATCH_UP_TOKENS, MAX_FUSED_CATCH_UP


class DraftCatchUp:
    def __init__(self) -> None:
        self._num_known: dict[int, int] = {}  # seq_id -> tokens whose draft KV the worker holds

    def num_owed(self, seq: Sequence) -> int:
        """Tokens the draft model computes before the sequence's proposing forward (which
        computes its last known token)."""
        return max(0, len(seq.token_ids) - 1 - self._num_known.get(seq.seq_id, 0))

    def reached(self, seqs: list[Sequence]) -> list[bool]:
        """Whether each sequence, given drafts this step, proposes: it is within the few tokens
        the proposing forward computes, or the step's catch-up reaches its last known token.
        Where none is, the least behind one: it catches up over the next steps as it would."""
        owed = [self.num_owed(seq) for seq in seqs]
        reached = [n <= MAX_FUSED_CATCH_UP for n in owed]
        budget = MAX_CATCH_UP_TOKENS
        for i in sorted((i for i, n in enumerate(owed) if not reached[i]), key=owed.__getitem__):
            budget -= owed[i]
            if budget < 0:
                break
            reached[i] = True
        if owed and not any(reached):
            reached[min(range(len(owed)), key=owed.__getitem__)] = True
        return reached

    def trial(self, seqs: list[Sequence], counts: list[int]) -> list[int]:
        """A trial's drafts, one each, where they cost the least catch-up: for every sequence
        with drafts that owes none beyond the proposing forward, or else for the least behind
        one alone (a batch that turned speculation off has drifted behind)."""
        owed = [self.num_owed(seq) for seq in seqs]
        kept = [int(bool(count) and n <= MAX_FUSED_CATCH_UP) for count, n in zip(counts, owed,
                                                                                strict=True)]
        candidates = [i for i, count in enumerate(counts) if count]
        if candidates and not any(kept):
            kept[min(candidates, key=owed.__getitem__)] = 1
        return kept

    def proposed(self, seq: Sequence) -> None:
        """After a step the sequence proposed in, its tokens appended: the draft model holds
        all but the last two (the new token; a kept last draft, which it proposed but never
        computed)."""
        self._num_known[seq.seq_id] = len(seq.token_ids) - 2

    def behind(self, seq: Sequence) -> None:
        """After a step whose catch-up did not reach the sequence: it computed a chunk of it,
        at most the step's whole catch-up."""
        self._num_known[seq.seq_id] = min(self._num_known.get(seq.seq_id, 0) + MAX_CATCH_UP_TOKENS,
                                          len(seq.token_ids) - 2)

    def forget(self, seq_id: int) -> None:
        self._num_known.pop(seq_id, None)
