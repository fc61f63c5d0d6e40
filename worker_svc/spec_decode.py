"""Speculative decoding, the worker's side: verifying a sequence's draft tokens.

A sequence with k drafts has k + 1 logits rows this step: row j is the target model's next-token
distribution after its known tokens and drafts[:j]. Each row is sampled exactly as a plain decode
at that position would be (penalties, min_tokens, temperature, top-k/p, the (seed, position)
noise); draft j is accepted while row j drew it, and the first row that drew something else, or
row k, gives the next token.

For a proposer that names one token (n-gram, a draft model's greedy choice), this is rejection
sampling: its draft distribution
q is one-hot at d, so accepting with probability min(1, p(d) / q(d)) = p(d) and otherwise drawing
from norm(max(0, p - q)) = p without d is what a draw from p that is kept if it equals d does.
So greedy outputs equal speculation off token for token, and seeded random outputs are the same
tokens too: the draws are those speculation off makes. Logprobs are the target model's.
A draft model's sampled drafts come with the distributions they were drawn from (draft_probs):
those are tested against the target's by rejection sampling (rejection_sampler.py).
"""

from __future__ import annotations

import itertools

import torch
from pagedserve.services.common.step_plan import SampledSequence
from pagedserve.worker_svc.host_to_device import to_device
from pagedserve.worker_svc.rejection_sampler import launch_draft_tests, rejection_sample
from pagedserve.worker_svc.sampler import (
    HostSamples,
    PendingSamples,
    Sampler,
    SeqSamplingState,
)
from pagedserve.worker_svc.sequence_mirrors import CachedSequence
from pagedserve.worker_svc.token_bitmask import TokenBitmask


def sampling_state(seq: CachedSequence, num_drafts: int = 0) -> SeqSamplingState:
    """The state of `seq` after its first num_drafts drafts."""
    token_ids = seq.token_ids + seq.draft_token_ids[:num_drafts] if num_drafts else seq.token_ids
    return SeqSamplingState(seq_id=seq.seq_id, sampling=seq.sampling, token_ids=token_ids,
                            prompt_len=seq.prompt_len, seed=seq.seed, num_samples=seq.num_samples)


def launch_samples(sampler: Sampler, logits: torch.Tensor, seqs: list[CachedSequence],
                   token_bitmask: TokenBitmask | None = None) -> PendingSamples:
    """logits: the sampling rows of ModelInput.logits_indices first (then any others);
    token_bitmask: structured outputs' allowed tokens, row i ↔ seqs[i]."""
    if not any(s.draft_token_ids for s in seqs):  # the mirror's sequences are the states
        if token_bitmask is None:  # samplers without structured outputs take two arguments
            return sampler.launch(logits[:len(seqs)], seqs)
        return sampler.launch(logits[:len(seqs)], seqs, token_bitmask)
    states = [sampling_state(s, j) for s in seqs for j in range(len(s.draft_token_ids) + 1)]
    first_rows = list(itertools.accumulate((len(s.draft_token_ids) + 1 for s in seqs), initial=0))
    tested = [(seq, first) for seq, first in zip(seqs, first_rows, strict=False)
              if seq.draft_probs is not None]
    tests = None  # sampled drafts: their tests against the target's distributions
    if tested:
        draft_rows = [first + j for seq, first in tested for j in range(len(seq.draft_token_ids))]
        draft_states = [states[row] for row in draft_rows]
        tests = launch_draft_tests(
            sampler, sampler.logprobs(logits[to_device(draft_rows, torch.long, logits.device)],
                                      draft_states),
            torch.cat([seq.draft_probs[:len(seq.draft_token_ids)] for seq, _ in tested]),
            [t for seq, _ in tested for t in seq.draft_token_ids], draft_states)
    if token_bitmask is not None:
        # constrained sequences carry no drafts (the mirror refuses them): one row each, moved
        # to where its sequence's rows start among the verified rows
        token_bitmask = TokenBitmask([first_rows[row] for row in token_bitmask.rows],
                                     token_bitmask.bits)
        rows = sampler.launch(logits[:len(states)], states, token_bitmask)
    else:
        rows = sampler.launch(logits[:len(states)], states)
    return VerifiedSamples(rows, seqs, tests)


class VerifiedSamples:
    """One draw per row; result() keeps each sequence's accepted prefix and the next token."""

    def __init__(self, rows: PendingSamples, seqs: list[CachedSequence],
                 tests: torch.Tensor | None) -> None:  # [4, num_sampled_drafts]
        self._rows = rows
        self._seqs = seqs
        self._tests = tests
        self._first_rows = []
        row = 0
        for seq in seqs:
            self._first_rows.append(row)
            row += len(seq.draft_token_ids) + 1
        self.token_ids = rows.token_ids
        self.offsets = [rows.offsets[row] for row in self._first_rows] + [rows.offsets[-1]]

    def host_samples(self) -> HostSamples:
        return HostSamples(self.result(), [], [], [])

    def result(self) -> list[SampledSequence]:
        rows = self._rows.result()
        tests = [] if self._tests is None else self._tests.tolist()
        out = []
        start = 0
        for seq, first in zip(self._seqs, self._first_rows, strict=True):
            seq_rows = rows[first:first + len(seq.draft_token_ids) + 1]
            if seq.draft_probs is not None:
                end = start + len(seq.draft_token_ids)
                out.append(rejection_sample([t[start:end] for t in tests], seq.draft_token_ids,
                                            seq_rows, seq.seq_id))
                start = end
            else:
                out.append(verify(seq, seq_rows))
        return out


def verify(seq: CachedSequence, rows: list[SampledSequence]) -> SampledSequence:
    """rows: the draws after drafts[:j], j = 0..k."""
    drafts = seq.draft_token_ids
    if not drafts:
        return rows[0]
    num_accepted = 0
    while num_accepted < len(drafts) and rows[num_accepted].token_ids[0] == drafts[num_accepted]:
        num_accepted += 1
    kept = rows[:num_accepted + 1]
    return SampledSequence(
        seq_id=seq.seq_id, token_ids=[r.token_ids[0] for r in kept],
        logprobs=[r.logprobs[0] for r in kept],
        top_logprobs=[top for r in kept for top in r.top_logprobs])
