"""One beam-search step for a group, with Hugging Face transformers' rules (early_stopping=False):
of the best 2*beam_width (beam, token) candidates, one that ends its beam becomes a hypothesis if
it ranks among the best beam_width; the best beam_width others continue, the first continuation
of a beam in its sequence, further ones in forks. The search stops when no beam continues, or
when the best live beam cannot beat the worst of beam_width hypotheses.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.scheduler_svc.sequence import BeamHypothesis, Sequence, SequenceGroup
from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.step_plan import SampledSequence, TokenIdLogprob


@dataclass(slots=True)
class _Candidate:
    parent: Sequence
    token_id: int
    logprob: float
    top_logprobs: list[TokenIdLogprob] | None
    cumulative_logprob: float


def beam_search_step(group: SequenceGroup, sampled: list[tuple[Sequence, SampledSequence]],
                     stop_reason: Callable[[Sequence, int], FinishReason | None],
                     fork: Callable[[SequenceGroup, Sequence], Sequence],
                     free: Callable[[Sequence], None]) -> None:
    beam_width = group.beam_width
    length_penalty = group.sampling.length_penalty
    candidates: list[_Candidate] = []
    for seq, out in sampled:
        for i, (token_id, logprob) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            if logprob == -math.inf:  # masked (structured outputs): never a continuation
                continue
            top = out.top_logprobs[i] if i < len(out.top_logprobs) else None
            candidates.append(_Candidate(seq, token_id, logprob, top,
                                         seq.cumulative_logprob + logprob))
    candidates.sort(key=lambda c: c.cumulative_logprob, reverse=True)
    candidates = candidates[:2 * beam_width]

    continuing: list[_Candidate] = []
    for rank, cand in enumerate(candidates):
        reason = stop_reason(cand.parent, cand.token_id)
        if reason is None:
            if len(continuing) < beam_width:
                continuing.append(cand)
        elif rank < beam_width:
            num_output_tokens = cand.parent.num_output_tokens + 1
            group.beam_hypotheses.append(BeamHypothesis(
                token_ids=cand.parent.output_token_ids + [cand.token_id],
                cumulative_logprob=cand.cumulative_logprob,
                score=cand.cumulative_logprob / num_output_tokens ** length_penalty,
                logprobs=cand.parent.output_logprobs + [cand.logprob],
                top_logprobs=cand.parent.output_top_logprobs
                + ([cand.top_logprobs] if cand.top_logprobs is not None else []),
                finish_reason=reason))
    group.beam_hypotheses.sort(key=lambda h: h.score, reverse=True)
    del group.beam_hypotheses[beam_width:]

    # fork before any parent changes: a child copies its parent's tokens as they are now
    reused: set[int] = set()
    new_beams: list[tuple[Sequence, _Candidate]] = []
    for cand in continuing:
        if cand.parent.seq_id in reused:
            new_beams.append((fork(group, cand.parent), cand))
        else:
            reused.add(cand.parent.seq_id)
            new_beams.append((cand.parent, cand))
    for seq, _ in sampled:
        if seq.seq_id not in reused:
            seq.finish(FinishReason.STOP)
            free(seq)
    for seq, cand in new_beams:
        seq.append_token(cand.token_id, cand.logprob, cand.top_logprobs)
    group.has_forked = True
    if new_beams:
        group.seqs = [seq for seq, _ in new_beams]
    else:  # keep the finished sequences: the group still needs its prompt
        group.seqs = [seq for seq, _ in sampled]
    if _is_done(group, [seq for seq, _ in new_beams], beam_width, length_penalty):
        for seq, _ in new_beams:
            seq.finish(FinishReason.STOP)
            free(seq)


def _is_done(group: SequenceGroup, beams: list[Sequence], beam_width: int,
             length_penalty: float) -> bool:
    """`beams` are best first."""
    if not beams:
        return True
    if len(group.beam_hypotheses) < beam_width:
        return False
    best = beams[0]
    best_score = best.cumulative_logprob / best.num_output_tokens ** length_penalty
    return group.beam_hypotheses[-1].score >= best_score
