"""Rejection sampling of a draft model's sampled proposals.

A sampled draft d_j was drawn from the draft model's distribution q_j; the target's is p_j (both
after the request's sampling processing). d_j is kept with probability min(1, p_j(d_j) / q_j(d_j));
the first rejected one is replaced by a draw from norm(max(0, p_j - q_j)); when every draft is
kept, the target's own draw at the next position follows. Each emitted token then follows the
target's distribution, whatever q is.

Every random number comes from the sequence's seed and the token's position, as a plain draw's
noise does (seeded_noise.step_seed), in streams of their own: the draft's draw (seeded_noise's
hashed noise, every row in one race), and the acceptance test with the replacement draw (a
generator per draft). A seeded request's outputs therefore repeat from run to run, batched or
not; an unseeded one uses the global generator.
"""

from __future__ import annotations

import torch
from pagedserve.services.common.step_plan import SampledSequence
from pagedserve.worker_svc.host_to_device import to_device
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState
from pagedserve.worker_svc.seeded_noise import draw_keys, step_seed

# XORed into step_seed's value so that each stream's noise is unrelated to the plain draw's
_DRAFT_STREAM = 0x2545F4914F6CDD1D
_ACCEPT_STREAM = 0x5851F42D4C957F2D


def _generator(seed: int | None, position: int, stream: int,
               device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(step_seed(seed, position) ^ stream)
    return generator


def _race(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """A draw from probs [vocab] (unnormalized is fine): argmax(probs / Exponential(1))."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int(probs.div(noise.clamp_min_(torch.finfo(noise.dtype).tiny)).argmax())


def draw_drafts(sampler: Sampler,
                probs: torch.Tensor,  # [num_rows, vocab]; row i after states[i].token_ids
                states: list[SeqSamplingState]) -> list[int]:
    """The draft model's tokens, one a row, from one race over every row."""
    order = sorted(range(len(states)), key=lambda i: states[i].seed is not None)
    seeded = [states[i] for i in order if states[i].seed is not None]
    keys = draw_keys([s.seed for s in seeded], [len(s.token_ids) for s in seeded],
                     [1] * len(seeded), _DRAFT_STREAM)
    drawn = sampler.race(probs[to_device(order, torch.long, probs.device)],
                         len(order) - len(seeded), keys).tolist()
    tokens = [0] * len(states)
    for i, token in zip(order, drawn, strict=True):
        tokens[i] = token
    return tokens


def rejection_sample(
    target_logprobs: torch.Tensor,  # [k + 1, vocab]; row j after the known tokens and drafts[:j]
    draft_probs: torch.Tensor,  # [k, vocab]; row j the distribution drafts[j] was drawn from
    drafts: list[int],
    rows: list[SampledSequence],  # the target's plain draws, row by row (k + 1)
    state: SeqSamplingState,  # before the drafts
) -> SampledSequence:
    """The kept drafts and the next token, with the target's logprobs."""
    position = len(state.token_ids)
    target_probs = target_logprobs.exp()
    token_ids: list[int] = []
    for j, draft in enumerate(drafts):
        generator = _generator(state.seed, position + j, _ACCEPT_STREAM, target_probs.device)
        p, q = target_probs[j], draft_probs[j]
        u = float(torch.rand((), generator=generator, device=p.device))
        if u * float(q[draft]) < float(p[draft]):
            token_ids.append(draft)
            continue
        residual = (p - q).clamp_min_(0.0)
        token_ids.append(_race(residual if float(residual.sum()) > 0.0 else p, generator))
        break
    else:
        token_ids.append(rows[len(drafts)].token_ids[0])
    logprobs = target_logprobs[range(len(token_ids)), token_ids].tolist()
    kept_rows = rows[:len(token_ids)]
    return SampledSequence(seq_id=state.seq_id, token_ids=token_ids, logprobs=logprobs,
                           top_logprobs=[top for r in kept_rows for top in r.top_logprobs])
