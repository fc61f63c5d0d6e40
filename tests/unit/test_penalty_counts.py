"""Penalty counts kept from step to step (PenaltyCounts) give, at every step, the logits that
counting every history from scratch (apply_penalties) gives: histories that grow in place,
sequences that finish and arrive, one sent whole again (a new list), a draft's rows (lists of
their own) beside their sequence's, and more sequences over time than the rows it keeps."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from pagedserve.worker_svc.penalties import PenaltyCounts, apply_penalties

VOCAB = 40


def _penalties(states, counts, logits):
    params = [(1.0 + 0.1 * (s.seq_id % 4), 0.2 * (s.seq_id % 3), 0.5) for s in states]
    reps, freqs, pres = (list(p) for p in zip(*params, strict=True))
    expected = apply_penalties(logits.clone(), [s.token_ids for s in states],
                               [s.prompt_len for s in states], reps, freqs, pres)
    return counts.apply(logits.clone(), states, reps, freqs, pres), expected


@pytest.mark.parametrize("seed", range(3))
def test_kept_counts_give_the_logits_of_counting_from_scratch(seed):
    check_kept_counts(seed, torch.device("cpu"))


def check_kept_counts(seed: int, device: torch.device) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    counts = PenaltyCounts(VOCAB, device)
    live: dict[int, SimpleNamespace] = {}
    next_id = peak = 0
    for step in range(60):
        for _ in range(rng.randrange(3)):  # arrivals, with prompts of 1-12 tokens
            prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 13))]
            live[next_id] = SimpleNamespace(seq_id=next_id, token_ids=prompt,
                                            prompt_len=len(prompt))
            next_id += 1
        for seq_id in rng.sample(sorted(live), k=min(len(live), rng.randrange(3))):
            del live[seq_id]  # finished
        if live and step % 7 == 3:  # sent whole again: the same history in a new list
            seq = live[rng.choice(sorted(live))]
            seq.token_ids = list(seq.token_ids)
        states = [live[seq_id] for seq_id in sorted(live)]
        peak = max(peak, len(states))
        if states and step % 5 == 0:  # verified drafts: rows whose histories end in drafts
            drafted = states[0]
            drafts = [rng.randrange(VOCAB) for _ in range(2)]
            states = [drafted] + [SimpleNamespace(seq_id=drafted.seq_id, prompt_len=drafted.prompt_len,
                                                  token_ids=drafted.token_ids + drafts[:j])
                                  for j in (1, 2)] + states[1:]
        if states:
            out, expected = _penalties(states, counts,
                                       torch.randn(len(states), VOCAB, device=device) * 3)
            assert torch.equal(out, expected), step
        for seq in live.values():  # each draws a token, appended to its history in place
            seq.token_ids.append(rng.randrange(VOCAB))
    assert next_id > 2 * peak and counts.num_rows < 2 * peak  # finished sequences' rows reused


def test_rows_are_reused_least_recently_used_first_and_grow_when_one_step_needs_more():
    counts = PenaltyCounts(VOCAB, torch.device("cpu"))
    batch = [SimpleNamespace(seq_id=i, token_ids=[i, 1], prompt_len=1) for i in range(9)]
    _penalties(batch, counts, torch.zeros(9, VOCAB))
    assert counts.num_rows == 16  # 8, then twice that for the ninth
    later = [SimpleNamespace(seq_id=100 + i, token_ids=[2, i], prompt_len=1) for i in range(10)]
    out, expected = _penalties(later, counts, torch.zeros(10, VOCAB))
    assert torch.equal(out, expected) and counts.num_rows == 16
