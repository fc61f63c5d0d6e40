"""Rejection sampling of a draft model's sampled proposals.

A sampled draft d_j was drawn from the draft model's distribution q_j; the target's is p_j (both
after the request's sampling processing). d_j is kept with probability min(1, p_j(d_j) / q_j(d_j));
the first rejected one is replaced by a draw from norm(max(0, p_j - q_j)); when every draft is
kept, the target's own draw at the next position follows. Each emitted token then follows the
target's distribution, whatever q is.

Every random number comes from the sequence's seed and the token's position, as a plain draw's
noise does (seeded_noise.draw_keys), in streams of their own: the draft's draw, and the
acceptance test with the replacement draw. Each is one pass over every row of a step, with no
host sync. A seeded request's outputs therefore repeat from run to run, batched or not; an
unseeded one uses the global generator.
"""

from __future__ import annotations

import torch
from pagedserve.services.common.step_plan import SampledSequence
from pagedserve.worker_svc.host_to_device import to_device
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState
from pagedserve.worker_svc.seeded_noise import draw_keys

# draw_keys' streams: each one's noise is unrelated to the plain draw's
_DRAFT_STREAM = 0x2545F4914F6CDD1D
_ACCEPT_STREAM = 0x5851F42D4C957F2D


def draw_drafts(sampler: Sampler,
                probs: torch.Tensor,  # [num_rows, vocab]; row i after states[i].token_ids
                states: list[SeqSamplingState]) -> list[int]:
    """The draft model's tokens, one a row, from one race over every row."""
    order, num_unseeded, keys = _unseeded_first(states, 1, _DRAFT_STREAM)
    drawn = sampler.race(probs[to_device(order, torch.long, probs.device)], num_unseeded,
                         keys).tolist()
    tokens = [0] * len(states)
    for i, token in zip(order, drawn, strict=True):
        tokens[i] = token
    return tokens


def _unseeded_first(states: list[SeqSamplingState], num_samples: int,
                    stream: int) -> tuple[list[int], int, list[int]]:
    """The rows' order with the unseeded ones first (the global RNG fills one slice), how many
    those are, and num_samples keys of each seeded row in the stream."""
    order = sorted(range(len(states)), key=lambda i: states[i].seed is not None)
    seeded = [states[i] for i in order if states[i].seed is not None]
    keys = draw_keys([s.seed for s in seeded], [len(s.token_ids) for s in seeded],
                     [num_samples] * len(seeded), stream)
    return order, len(order) - len(seeded), keys


def launch_draft_tests(
    sampler: Sampler,
    target_logprobs: torch.Tensor,  # [num_drafts, vocab]; the target's row of each draft
    draft_probs: torch.Tensor,  # [num_drafts, vocab]; the distribution each was drawn from
    drafts: list[int],
    states: list[SeqSamplingState],  # per draft: its sequence after the drafts before it
) -> torch.Tensor:  # [4, num_drafts] float64
    """Every draft's test at once, nothing waiting for the device: 1 where the draft is kept,
    the token that replaces it where it is not, and the target's logprobs of both."""
    device = target_logprobs.device
    # per seeded draft, sample 0 of its stream is the test's uniform, sample 1 the race's noise
    order, num_unseeded, keys = _unseeded_first(states, 2, _ACCEPT_STREAM)
    index = to_device(order, torch.long, device)
    logprobs = target_logprobs[index]  # [num_drafts, vocab], unseeded first
    p, q = logprobs.exp(), draft_probs[index]
    ids = to_device([drafts[i] for i in order], torch.long, device).unsqueeze(1)
    u = sampler.uniforms(num_unseeded, keys[0::2])
    is_kept = u * q.gather(1, ids).squeeze(1) < p.gather(1, ids).squeeze(1)
    residual = (p - q).clamp_min_(0.0)
    residual = torch.where(residual.sum(dim=1, keepdim=True) > 0.0, residual, p)
    replacements = sampler.race(residual, num_unseeded, keys[1::2]).unsqueeze(1)
    tests = torch.stack([is_kept.double(), replacements.squeeze(1).double(),
                         logprobs.gather(1, ids).squeeze(1).double(),
                         logprobs.gather(1, replacements).squeeze(1).double()])
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return tests[:, to_device(inverse, torch.long, device)]


def rejection_sample(
    tests: list[list[float]],  # launch_draft_tests' 4 rows, this sequence's k columns
    drafts: list[int],
    rows: list[SampledSequence],  # the target's plain draws, row by row (k + 1)
    seq_id: int,
) -> SampledSequence:
    """The kept drafts and the next token, with the target's logprobs."""
    is_kept, replacements, draft_logprobs, replacement_logprobs = tests
    token_ids: list[int] = []
    logprobs: list[float] = []
    for j, draft in enumerate(drafts):
        if is_kept[j]:
            token_ids.append(draft)
            logprobs.append(draft_logprobs[j])
            continue
        token_ids.append(int(replacements[j]))
        logprobs.append(replacement_logprobs[j])
        break
    else:
        token_ids.append(rows[len(drafts)].token_ids[0])
        logprobs.append(rows[len(drafts)].logprobs[0])
    kept_rows = rows[:len(token_ids)]
    return SampledSequence(seq_id=seq_id, token_ids=token_ids, logprobs=logprobs,
                           top_logprobs=[top for r in kept_rows for top in r.top_logprobs])
