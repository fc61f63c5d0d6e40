"""Embeddings of prompt-only requests (vLLM's pooling runner): the final hidden states of a
prompt pooled by its last token or by their mean, then L2-normalized. A prompt prefilled in
chunks adds each chunk's rows to a running sum on its mirror; the vector is made in the step
that computes the prompt's last token."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from pagedserve.services.common.step_plan import PooledSequence
from pagedserve.worker_svc.sequence_mirrors import CachedSequence


@dataclass(slots=True)
class PoolSpan:
    """Hidden-state rows [start, end) are this step's chunk of a pooling sequence."""

    seq: CachedSequence
    start: int
    end: int
    is_last_chunk: bool


def pool(hidden_states: torch.Tensor, spans: list[PoolSpan]
         ) -> list[tuple[int, torch.Tensor]]:
    """hidden_states: [num_tokens, hidden]. Returns (seq_id, [hidden] float32 unit vector) for
    each sequence whose prompt is done, queued on the device."""
    pooled = []
    for span in spans:
        seq = span.seq
        rows = hidden_states[span.start:span.end]  # [chunk, hidden]
        if seq.pooling_type == "mean":
            chunk_sum = rows.float().sum(dim=0)
            seq.pooled_sum = chunk_sum if seq.pooled_sum is None else seq.pooled_sum + chunk_sum
        if not span.is_last_chunk:
            continue
        if seq.pooling_type == "mean":
            vector = seq.pooled_sum / seq.prompt_len
        else:
            vector = rows[-1].float()
        pooled.append((seq.seq_id, F.normalize(vector, dim=0)))
    return pooled


def pooled_to_host(pooled: list[tuple[int, torch.Tensor]]) -> list[PooledSequence]:
    if not pooled:
        return []
    vectors = torch.stack([v for _, v in pooled]).cpu().tolist()  # one copy for the step
    return [PooledSequence(seq_id, vector)
            for (seq_id, _), vector in zip(pooled, vectors, strict=True)]
