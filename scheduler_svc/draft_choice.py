"""Which drafts a step verifies: those that give the step the most expected tokens per second,
counting what the target model's step costs per token and what a draft model's proposing costs
per draft position.

A draft model proposes position by position: each position is one forward of the draft model
over every sequence still drafting, so its cost is a fixed part per position (the draft's
weights read once, its launches, the host reading the drafts) and a part per drafting sequence.
The fixed part is paid for the longest draft of the step, which a rate per draft token cannot
see: at a large batch the target's step is long and the drafts' positions add little, at a small
batch they may add more than the kept drafts save. So the choice tries every number of positions
k (0: no speculation), keeps the drafts that pay within it, and takes the best k. A step with
drafts also holds run-ahead back, so where the host's time per step is a large part of it (a
large batch's bookkeeping), no speculation gains that too. n-gram lookup's positions cost
nothing and its steps sent behind still draft, so its choice is the best set of drafts for the
target's step alone."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepCosts:
    """Seconds: the target's step is fixed_s + per_token_s * tokens; a draft model's proposing
    is draft_fixed_s per position + draft_per_seq_s per drafted token. host_s: the host's time
    per step outside the worker, which a step with drafts adds to its own (the next step waits
    for its tokens); where steps run ahead, a step without drafts overlaps it, and the worker's
    host part of fixed_s (worker_host_s), with the device's."""

    fixed_s: float
    per_token_s: float
    draft_fixed_s: float = 0.0
    draft_per_seq_s: float = 0.0
    host_s: float = 0.0
    worker_host_s: float = 0.0
    runs_ahead: bool = True


def choose_drafts(rates: list[list[float]], num_known_tokens: int, num_expected: float,
                  costs: StepCosts) -> list[int]:
    """How many of its drafts each sequence keeps. rates[i][j]: the chance that sequence i's
    draft j and every one before it are kept (non-increasing in j); num_known_tokens: the
    step's tokens other than drafts; num_expected: the tokens it surely yields.

    Within k positions, drafts are added most likely first while one raises the step's
    expected tokens per second: one kept with probability p, at a marginal cost c, pays when
    (y + p) / (t + c) > y / t, i.e. p * t > c * y. Once one does not pay, no later one does,
    so this is the best set of drafts within k positions. Ties go to more positions."""
    candidates = sorted(((p, j, i) for i, seq_rates in enumerate(rates)
                         for j, p in enumerate(seq_rates)), key=lambda c: (-c[0], c[1]))
    base_s = costs.fixed_s + costs.per_token_s * num_known_tokens
    marginal_s = costs.per_token_s + costs.draft_per_seq_s
    alone_s = base_s + costs.host_s
    if costs.runs_ahead:
        alone_s = max(base_s - costs.worker_host_s, costs.host_s + costs.worker_host_s)
    best, best_rate = [0] * len(rates), num_expected / alone_s
    for k in range(max(map(len, rates), default=0), 0, -1):
        kept = [0] * len(rates)
        num_tokens, time_s = num_expected, base_s + costs.host_s + k * costs.draft_fixed_s
        for p, j, i in candidates:
            if j >= k:
                continue
            if p * time_s <= marginal_s * num_tokens:
                break
            kept[i] += 1
            num_tokens += p
            time_s += marginal_s
        time_s -= (k - max(kept)) * costs.draft_fixed_s
        if num_tokens / time_s > best_rate:
            best, best_rate = kept, num_tokens / time_s
    return best
