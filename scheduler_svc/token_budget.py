"""The per-step budget (max_num_batched_tokens, max_num_seqs) and how many tokens of a group fit
in what is left of it."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve.scheduler_svc.sequence import Sequence, SequenceGroup


@dataclass(slots=True)
class TokenBudget:
    max_num_tokens: int
    max_num_seqs: int
    num_tokens: int = 0
    num_seqs: int = 0

    @property
    def remaining_tokens(self) -> int:
        return self.max_num_tokens - self.num_tokens

    @property
    def remaining_seqs(self) -> int:
        return self.max_num_seqs - self.num_seqs

    def fits(self, num_seqs: int, num_tokens: int) -> bool:
        return (self.num_seqs + num_seqs <= self.max_num_seqs
                and self.num_tokens + num_tokens <= self.max_num_tokens)


def assign_tokens(group: SequenceGroup, budget: TokenBudget, is_chunked: bool,
                  cap: int | None = None) -> list[tuple[Sequence, int]] | None:
    """None if none fit. The sequences of a multi-sequence prefill stop one token short, so they
    all sample together in one later step (beam search needs every beam's candidates at once)."""
    live = group.live_seqs()
    if budget.remaining_seqs < len(live):
        return None
    if group.is_decode_phase():
        return assign_decode(live, budget)
    left = budget.remaining_tokens
    if cap is not None:
        left = min(left, cap)
    if len(live) == 1:
        want = live[0].num_uncomputed_tokens
        num_tokens = min(want, left) if is_chunked else (want if want <= left else 0)
        return [(live[0], num_tokens)] if num_tokens > 0 else None
    assignment = []
    for seq in live:
        want = seq.num_uncomputed_tokens - 1
        num_tokens = min(want, left) if is_chunked else want
        if num_tokens > 0:
            assignment.append((seq, num_tokens))
            left -= num_tokens
    return assignment if assignment and left >= 0 else None


def assign_decode(live: list[Sequence], budget: TokenBudget) -> list[tuple[Sequence, int]] | None:
    """A decoding group's live sequences, one token each; None if they do not all fit."""
    return [(seq, 1) for seq in live] if budget.fits(len(live), len(live)) else None
