"""CUDA graphs for mixed steps (prefill chunks beside decodes: every step while requests keep
arriving), bucketed by token count (worker_svc/graph_buckets.py).

Whole-step graphs rather than piecewise ones around attention, because the Triton unified
attention kernel already serves a mixed batch in one launch whose geometry comes from host
bounds only, and reads every real length from device tensors (kernels/triton_ops.py). So the
capture metadata of a bucket of T tokens and S sequence slots holds bounds (S sequences of T
query tokens, all taken by the unified kernel: the split-KV decode kernels take their first
sequence as a host scalar, which differs from step to step) and a step is copied into static
buffers:
- tokens past the step's are padding: slot -1 writes no KV, and the last slot's sequence owns
  them all (context 0, block table of zeros, so they attend to finite keys of block 0 only);
  their hidden states are never read, so they produce no sample;
- sequence slots past the step's and before the padding owner have no query tokens: their
  programs return at once.
Graphs run only with the Triton backend (flash-attn sizes its varlen launch by host lengths).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.cdiv import cdiv
from pagedserve.worker_svc.cuda_graphs import DecodeGraphs, capture_largest_first, is_decode_only
from pagedserve.worker_svc.graph_buckets import GraphBuckets, graph_bucket, mixed_num_seqs
from pagedserve.worker_svc.model_input import ModelInput
from torch import nn

logger = logging.getLogger(__name__)

MIXED_CAPTURABLE_BACKENDS = ("triton",)


@dataclass(slots=True)
class MixedBuffers:
    input_ids: torch.Tensor  # [max_num_tokens] int64
    positions: torch.Tensor  # [max_num_tokens] int64
    slot_mapping: torch.Tensor  # [max_num_tokens] int64
    block_tables: torch.Tensor  # [max_num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [max_num_seqs] int32
    query_start_loc: torch.Tensor  # [max_num_seqs + 1] int32

    @classmethod
    def allocate(cls, max_num_tokens: int, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> MixedBuffers:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            input_ids=zeros(max_num_tokens, dtype=torch.int64),
            positions=zeros(max_num_tokens, dtype=torch.int64),
            slot_mapping=torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device),
            block_tables=zeros(max_num_seqs, max_blocks_per_seq, dtype=torch.int32),
            seq_lens=zeros(max_num_seqs, dtype=torch.int32),
            query_start_loc=zeros(max_num_seqs + 1, dtype=torch.int32))

    def load(self, model_input: ModelInput, num_tokens: int, num_seqs: int) -> None:
        """Copies the step into the first rows and slots of a bucket of num_tokens rows and
        num_seqs slots, and pads the rest; device-to-device copies only."""
        meta = model_input.meta
        n, s = model_input.num_tokens, meta.num_seqs
        width = meta.block_tables.shape[1]
        if n > num_tokens or s >= num_seqs or width > self.block_tables.shape[1]:
            raise ValueError(f"a step of {n} tokens, {s} sequences and {width} blocks per "
                             f"sequence does not fit a bucket of {num_tokens} tokens, "
                             f"{num_seqs - 1} sequences and {self.block_tables.shape[1]} blocks")
        self.input_ids[:n].copy_(model_input.input_ids)
        self.positions[:n].copy_(model_input.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.input_ids[n:num_tokens].zero_()
        self.positions[n:num_tokens].zero_()
        self.slot_mapping[n:num_tokens].fill_(-1)
        # columns past `width` keep stale block ids: kernels read only the blocks below seq_len
        self.block_tables[:s, :width].copy_(meta.block_tables)
        self.block_tables[s:num_seqs].zero_()
        self.seq_lens[:s].copy_(meta.seq_lens)
        self.seq_lens[s:num_seqs].zero_()
        self.seq_lens[num_seqs - 1].fill_(num_tokens - n)  # the padding's owner
        self.query_start_loc[:s + 1].copy_(meta.query_start_loc)
        self.query_start_loc[s + 1:num_seqs].fill_(n)
        self.query_start_loc[num_seqs].fill_(num_tokens)

    def metadata(self, num_tokens: int, num_seqs: int, max_seq_len: int) -> AttentionMetadata:
        """Host fields hold the bounds the launches are sized by: every slot a prefill of
        num_tokens queries (so no split-KV decode launch), no context beyond max_seq_len."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:num_tokens],
            block_tables=self.block_tables[:num_seqs],
            seq_lens=self.seq_lens[:num_seqs],
            query_start_loc=self.query_start_loc[:num_seqs + 1],
            max_query_len=num_tokens,
            max_seq_len=max_seq_len,
            num_prefills=num_seqs,
            num_prefill_tokens=num_tokens,
            query_lens_cpu=[num_tokens] * num_seqs,
            seq_lens_cpu=[max_seq_len] * num_seqs,
        )


class MixedGraphs:
    def __init__(self, model: nn.Module, buckets: GraphBuckets, block_size: int,
                 device: torch.device) -> None:
        self.model = model
        self.buckets = buckets
        self.num_tokens = sorted(buckets.num_tokens)
        # the padding owner's context is up to a bucket long, whatever max_seq_len is
        self.max_seq_len = max(buckets.max_seq_len, self.num_tokens[-1])
        self.device = device
        self.buffers = MixedBuffers.allocate(
            self.num_tokens[-1], self.num_seqs(self.num_tokens[-1]),
            cdiv(self.max_seq_len, block_size), device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden_states: dict[int, torch.Tensor] = {}  # each graph's output [T, hidden]
        self.kv_caches: list[torch.Tensor] | None = None  # the cache the graphs were captured on
        self.num_replays = 0

    def num_seqs(self, num_tokens: int) -> int:
        return mixed_num_seqs(num_tokens, self.buckets.max_num_seqs)

    def run_static(self, num_tokens: int, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] of the buffers' first num_tokens rows."""
        buffers = self.buffers
        meta = buffers.metadata(num_tokens, self.num_seqs(num_tokens), self.max_seq_len)
        return self.model(buffers.input_ids[:num_tokens], buffers.positions[:num_tokens],
                          kv_caches, meta)

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], pool: tuple | None = None) -> None:
        """The buffers hold only padding (slot -1), so capturing writes nothing into the
        cache."""
        self.graphs, self.hidden_states = capture_largest_first(
            self.num_tokens, lambda t: self.run_static(t, kv_caches), pool, self.device)
        self.kv_caches = kv_caches
        logger.info("captured %d mixed-step CUDA graphs (tokens %s, seq len up to %d)",
                    len(self.graphs), self.num_tokens, self.buckets.max_seq_len)

    def num_tokens_for(self, model_input: ModelInput,
                       kv_caches: list[torch.Tensor]) -> int | None:
        """The mixed bucket a step replays in, or None (a decode graph's or an eager step)."""
        if kv_caches is not self.kv_caches:
            return None
        meta = model_input.meta
        bucket = graph_bucket(self.buckets, meta.num_seqs, model_input.num_tokens,
                              is_decode_only(meta), meta.max_seq_len)
        return bucket.size if bucket is not None and bucket.is_mixed else None

    def replay(self, model_input: ModelInput, num_tokens: int) -> torch.Tensor:
        """[num_tokens of the step, hidden]: a view of the graph's output, valid until the next
        replay."""
        self.buffers.load(model_input, num_tokens, self.num_seqs(num_tokens))
        self.graphs[num_tokens].replay()
        self.num_replays += 1
        return self.hidden_states[num_tokens][:model_input.num_tokens]


def capture_graphs(model: nn.Module, buckets: GraphBuckets, block_size: int,
                   kv_caches: list[torch.Tensor],
                   device: torch.device) -> tuple[DecodeGraphs, MixedGraphs | None]:
    """Both kinds into one pool, the kind with the larger graph first, so that the smaller
    graphs reuse what it freed (the memory profile reserves the larger peak only)."""
    decode = DecodeGraphs(model, buckets.batch_sizes, buckets.max_seq_len, block_size, device)
    mixed = MixedGraphs(model, buckets, block_size, device) if buckets.num_tokens else None
    pool = torch.cuda.graph_pool_handle()
    is_mixed_larger = mixed is not None and mixed.num_tokens[-1] > decode.batch_sizes[-1]
    if is_mixed_larger:
        mixed.capture(kv_caches, pool)
    decode.capture(kv_caches, pool)
    if mixed is not None and not is_mixed_larger:
        mixed.capture(kv_caches, pool)
    return decode, mixed


def replay_forward(model_input: ModelInput, kv_caches: list[torch.Tensor],
                   decode: DecodeGraphs | None, mixed: MixedGraphs | None) -> torch.Tensor | None:
    """The step's hidden states [num_tokens, hidden] from the graph it fits (a decode graph by
    batch size first, else a mixed one by tokens), or None: it runs eagerly."""
    batch_size = decode.batch_size_for(model_input, kv_caches) if decode else None
    if batch_size is not None:
        return decode.replay(model_input, batch_size)
    num_tokens = mixed.num_tokens_for(model_input, kv_caches) if mixed else None
    if num_tokens is not None:
        return mixed.replay(model_input, num_tokens)
    return None
