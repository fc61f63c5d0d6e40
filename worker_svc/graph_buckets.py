"""Which steps replay a CUDA graph, and which graph: the one rule that the worker's runner
(worker_svc/cuda_graphs.py, worker_svc/mixed_graphs.py) and the simulator's step model
(worker_svc/sim/step_model.py) both follow.

Decode-only steps replay a decode graph, bucketed by sequences; every other step (prefill
chunks beside decodes, or decodes past the largest decode bucket) replays a mixed graph,
bucketed by tokens. A step past the largest bucket or the capture length runs eagerly."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

MAX_CAPTURE_BATCH_SIZE = 256
MIN_CAPTURE_TOKENS = 8
DOUBLING_CAPTURE_TOKENS = 256


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then multiples of 8, up to and including min(max_num_seqs, 256)."""
    limit = min(max_num_seqs, MAX_CAPTURE_BATCH_SIZE)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    return [*sizes, limit]


def capture_num_tokens(max_cuda_graph_tokens: int, max_num_batched_tokens: int) -> list[int]:
    """Mixed-step buckets: 8, 16, 32, ... doubling up to 256, then every 128, up to and
    including the smaller limit. Up to a few hundred tokens a forward is bound by reading the
    weights, so padding costs little there; past that it is bound by FLOPs, which padding
    adds."""
    limit = min(max_cuda_graph_tokens, max_num_batched_tokens)
    if limit < 2:  # a mixed step has at least two tokens
        return []
    sizes, size = [], MIN_CAPTURE_TOKENS
    while size < limit:
        sizes.append(size)
        size = size * 2 if size < DOUBLING_CAPTURE_TOKENS else size + DOUBLING_CAPTURE_TOKENS // 2
    return [*sizes, limit]


def mixed_num_seqs(num_tokens: int, max_num_seqs: int) -> int:
    """Sequence slots of the mixed graph of num_tokens rows: as many sequences as a step of that
    size can have, and one more that owns the padding rows."""
    return min(num_tokens, max_num_seqs) + 1


def pick_batch_size(num_seqs: int, batch_sizes: list[int]) -> int | None:
    i = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[i] if i < len(batch_sizes) else None


@dataclass(frozen=True, slots=True)
class GraphBuckets:
    batch_sizes: list[int]  # decode graphs, by sequences (ascending)
    num_tokens: list[int]  # mixed graphs, by tokens (ascending)
    max_seq_len: int  # no graph serves a sequence longer than this
    max_num_seqs: int


def capture_buckets(max_num_seqs: int, max_num_batched_tokens: int, max_cuda_graph_tokens: int,
                    max_seq_len: int) -> GraphBuckets:
    return GraphBuckets(batch_sizes=capture_batch_sizes(max_num_seqs),
                        num_tokens=capture_num_tokens(max_cuda_graph_tokens,
                                                      max_num_batched_tokens),
                        max_seq_len=max_seq_len, max_num_seqs=max_num_seqs)


@dataclass(frozen=True, slots=True)
class GraphBucket:
    is_mixed: bool
    size: int  # sequences of a decode graph, tokens of a mixed one


def graph_bucket(buckets: GraphBuckets, num_seqs: int, num_tokens: int, is_decode_only: bool,
                 max_seq_len: int) -> GraphBucket | None:
    """The graph a step replays, or None to run it eagerly. is_decode_only: one new token per
    sequence and no prefill among them."""
    if max_seq_len > buckets.max_seq_len:
        return None
    if is_decode_only:
        batch_size = pick_batch_size(num_seqs, buckets.batch_sizes)
        if batch_size is not None:
            return GraphBucket(is_mixed=False, size=batch_size)
    size = pick_batch_size(num_tokens, buckets.num_tokens)
    if size is None or num_seqs >= mixed_num_seqs(size, buckets.max_num_seqs):
        return None
    return GraphBucket(is_mixed=True, size=size)
