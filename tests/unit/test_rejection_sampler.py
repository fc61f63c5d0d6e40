"""Rejection sampling of a draft model's sampled drafts: every emitted token follows the target's
distribution whatever the draft's, a draft is kept as often as min(p, q) allows, logprobs are the
target's, and a seed gives the same tokens every time."""

from __future__ import annotations

import pytest
import torch
from pagedserve.worker_svc.rejection_sampler import draw_drafts
from pagedserve.worker_svc.sampler import Sampler
from pagedserve.worker_svc.spec_decode import launch_samples, sampling_state

from tests.unit.test_sampler import CHI2_BOUND, chi_square
from tests.unit.test_seeded_noise import OpCounter
from tests.unit.test_spec_decode_verifier import CPU, cached

P = torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05],  # the target's rows, one per position
                  [0.05, 0.1, 0.15, 0.3, 0.4],
                  [0.2, 0.2, 0.2, 0.2, 0.2]])
Q = torch.tensor([[0.1, 0.1, 0.2, 0.2, 0.4],  # the draft's: far from the target's
                  [0.3, 0.3, 0.2, 0.1, 0.1]])
NUM_SEQS = 4000


def verified(seeds: list[int]):
    """Each sequence drafts 2 tokens from Q (seeded), then the target verifies them."""
    seqs = []
    sampler = Sampler(5, [4], CPU)
    for seed in seeds:
        seq = cached(seed, [], seed=seed, temperature=1.0)
        for q in Q:
            state = sampling_state(seq, len(seq.draft_token_ids))
            seq.draft_token_ids.append(draw_drafts(sampler, q.unsqueeze(0), [state])[0])
        seq.draft_probs = Q.clone()
        seqs.append(seq)
    logits = P.log().repeat(len(seqs), 1)
    return seqs, launch_samples(sampler, logits, seqs).result()


def test_every_emitted_token_follows_the_target_distribution():
    seqs, out = verified(list(range(NUM_SEQS)))
    for position, p in enumerate(P):
        tokens = torch.tensor([o.token_ids[position] for o in out if len(o.token_ids) > position])
        assert chi_square(torch.bincount(tokens, minlength=5).float(), p) < CHI2_BOUND, position
    # a draft is kept with probability sum(min(p, q)) = 0.5; a draw of the target that has to
    # equal the draft (the greedy drafts' test) keeps sum(p * q) = 0.14
    num_kept_first = sum(o.token_ids[0] == s.draft_token_ids[0]
                         for s, o in zip(seqs, out, strict=True))
    assert num_kept_first / NUM_SEQS == pytest.approx(float(torch.minimum(P[0], Q[0]).sum()),
                                                      abs=0.03)
    for o in out[:50]:
        assert o.logprobs == pytest.approx(
            [float(P[j, t].log()) for j, t in enumerate(o.token_ids)], abs=1e-5)


def test_a_seed_gives_the_same_tokens_alone_or_batched():
    _, batched = verified(list(range(64)))
    alone = [verified([seed])[1][0] for seed in (3, 41)]
    assert [o.token_ids for o in alone] == [batched[3].token_ids, batched[41].token_ids]
    _, again = verified(list(range(64)))
    assert [o.token_ids for o in again] == [o.token_ids for o in batched]
    assert len({tuple(o.token_ids) for o in batched}) > 10  # the seeds do vary the draws


def test_drawing_and_verifying_sampled_drafts_cost_no_op_per_sequence():
    def num_ops(num_seqs: int) -> int:
        sampler = Sampler(5, [4], CPU)
        seqs = [cached(seed, [], seed=seed, temperature=1.0) for seed in range(num_seqs)]
        with OpCounter() as counter:
            for q in Q:
                states = [sampling_state(s, len(s.draft_token_ids)) for s in seqs]
                drawn = draw_drafts(sampler, q.expand(num_seqs, 5), states)
                for s, token in zip(seqs, drawn, strict=True):
                    s.draft_token_ids.append(token)
            for s in seqs:
                s.draft_probs = Q
            launch_samples(sampler, P.log().repeat(num_seqs, 1), seqs).result()
        return counter.num_ops

    assert num_ops(24) == num_ops(2)
