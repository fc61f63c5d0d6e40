"""CUDA graphs for decode-only steps (mixed steps: worker_svc/mixed_graphs.py): at small batch sizes kernel launches, not math, set the
step time, so warm-up captures the forward once per decode batch-size bucket and a decode step
that fits a bucket replays the smallest such graph.

Replay is correct because:
- every graph reads the same preallocated input buffers (a step fills the first rows, the rest
  of its bucket is padding) and the KV-cache tensors it was captured on (graphs are dropped when
  the cache is replaced);
- launch geometry is fixed: capture metadata holds upper bounds in its host fields and the real
  lengths only in device tensors, which the Triton and flash-attn decode kernels read (the torch
  and ref backends shape work by host lengths and are never captured);
- a padding row writes no KV (slot -1) and attends to one finite key of block 0; its hidden
  state is never read.
Logits and sampling stay outside the graph.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.cdiv import cdiv
from pagedserve.worker_svc.graph_buckets import GraphBuckets, graph_bucket
from pagedserve.worker_svc.model_input import ModelInput
from torch import nn

logger = logging.getLogger(__name__)

# Bounds the graphs' split-KV scratch (it grows with the number of partitions) and their block
# tables; longer decodes are rare enough to run eagerly.
MAX_CAPTURE_SEQ_LEN = 8192
# Backends whose decode kernels need only the device seq_lens to be correct (see above).
CAPTURABLE_BACKENDS = ("triton", "flash_attn")


def is_decode_only(meta: AttentionMetadata) -> bool:
    return not meta.num_prefills and meta.max_query_len == 1


def decode_batch_size(meta: AttentionMetadata, batch_sizes: list[int],
                      max_seq_len: int) -> int | None:
    """The decode bucket a step replays in, or None (worker_svc/graph_buckets.py's rule)."""
    bucket = graph_bucket(GraphBuckets(batch_sizes, [], max_seq_len, max_num_seqs=0),
                          meta.num_seqs, meta.slot_mapping.shape[0], is_decode_only(meta),
                          meta.max_seq_len)
    return bucket.size if bucket is not None else None


@dataclass(slots=True)
class DecodeBuffers:
    input_ids: torch.Tensor  # [max_batch_size] int64
    positions: torch.Tensor  # [max_batch_size] int64
    slot_mapping: torch.Tensor  # [max_batch_size] int64
    block_tables: torch.Tensor  # [max_batch_size, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [max_batch_size] int32
    query_start_loc: torch.Tensor  # [max_batch_size + 1] int32: 0, 1, 2, ... (one token each)
    # rows from this one on hold padding; below it, rows past a step's own may hold an earlier
    # step's (a padding row's slot must be -1: it would write its K/V there)
    padded_from: int = 0

    @classmethod
    def allocate(cls, max_batch_size: int, max_blocks_per_seq: int,
                 device: torch.device) -> DecodeBuffers:
        def rows(fill: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.full((max_batch_size,), fill, dtype=dtype, device=device)

        return cls(
            input_ids=rows(0, torch.int64), positions=rows(0, torch.int64),
            slot_mapping=rows(-1, torch.int64),
            block_tables=torch.zeros(max_batch_size, max_blocks_per_seq, dtype=torch.int32,
                                     device=device),
            seq_lens=rows(1, torch.int32),
            query_start_loc=torch.arange(max_batch_size + 1, dtype=torch.int32, device=device))

    def load(self, model_input: ModelInput, batch_size: int) -> None:
        """Device-to-device copies only: nothing waits for the host. The rows past the step's
        own are padded where an earlier step left its rows: in a steady batch, not at all."""
        meta = model_input.meta
        n = model_input.num_tokens  # one token per sequence
        width = meta.block_tables.shape[1]
        if width > self.block_tables.shape[1] or batch_size < n:
            raise ValueError(f"a decode batch of {n} rows with {width} blocks per sequence does "
                             f"not fit a bucket of {batch_size} rows and "
                             f"{self.block_tables.shape[1]} blocks")
        self.input_ids[:n].copy_(model_input.input_ids)
        self.positions[:n].copy_(model_input.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        # columns past `width` keep stale block ids: kernels read only the blocks below seq_len
        self.block_tables[:n, :width].copy_(meta.block_tables)
        end = min(self.padded_from, batch_size)  # the rows of the bucket left to pad
        if end > n:
            self.input_ids[n:end].zero_()
            self.positions[n:end].zero_()
            self.slot_mapping[n:end].fill_(-1)
            self.seq_lens[n:end].fill_(1)
            self.block_tables[n:end].zero_()
        if self.padded_from <= batch_size:
            self.padded_from = n

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            query_start_loc=self.query_start_loc[:batch_size + 1],
            max_query_len=1,
            max_seq_len=max_seq_len,
            num_prefills=0,
            num_prefill_tokens=0,
            query_lens_cpu=[1] * batch_size,
            seq_lens_cpu=[max_seq_len] * batch_size,
        )


class DecodeGraphs:
    def __init__(self, model: nn.Module, batch_sizes: list[int], max_seq_len: int,
                 block_size: int, device: torch.device) -> None:
        self.model = model
        self.batch_sizes = sorted(batch_sizes)
        self.max_seq_len = max_seq_len
        self.device = device
        max_blocks_per_seq = cdiv(max_seq_len, block_size)
        self.buffers = DecodeBuffers.allocate(self.batch_sizes[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.hidden_states: dict[int, torch.Tensor] = {}  # each graph's output [B, hidden]
        self.kv_caches: list[torch.Tensor] | None = None  # the cache the graphs were captured on
        self.num_replays = 0

    def run_static(self, batch_size: int, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """Hidden states [batch_size, hidden] of the buffers' first batch_size rows."""
        buffers = self.buffers
        return self.model(buffers.input_ids[:batch_size], buffers.positions[:batch_size],
                          kv_caches, buffers.metadata(batch_size, self.max_seq_len))

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor], pool: tuple | None = None) -> None:
        """The buffers hold only padding, so capturing writes nothing into the cache."""
        self.graphs, self.hidden_states = capture_largest_first(
            self.batch_sizes, lambda b: self.run_static(b, kv_caches), pool, self.device)
        self.kv_caches = kv_caches
        logger.info("captured %d decode CUDA graphs (batch sizes %s, seq len up to %d)",
                    len(self.graphs), self.batch_sizes, self.max_seq_len)

    def batch_size_for(self, model_input: ModelInput,
                       kv_caches: list[torch.Tensor]) -> int | None:
        if kv_caches is not self.kv_caches:
            return None
        return decode_batch_size(model_input.meta, self.batch_sizes, self.max_seq_len)

    def replay(self, model_input: ModelInput, batch_size: int) -> torch.Tensor:
        """[num_tokens, hidden]: a view of the graph's output, valid until the next replay."""
        self.buffers.load(model_input, batch_size)
        self.graphs[batch_size].replay()
        self.num_replays += 1
        return self.hidden_states[batch_size][:model_input.num_tokens]


def capture_largest_first(sizes: list[int], run: Callable[[int], torch.Tensor],
                          pool: tuple | None, device: torch.device
                          ) -> tuple[dict[int, torch.cuda.CUDAGraph], dict[int, torch.Tensor]]:
    """One graph of `run(size)` per size, and its output, largest first into one pool, so the
    smaller graphs fit into what the largest left; then the warm-up runs' activations go back,
    so what stays reserved is the graphs'."""
    pool = pool or torch.cuda.graph_pool_handle()
    graphs, outputs = {}, {}
    for size in sorted(sizes, reverse=True):
        graphs[size], outputs[size] = capture_graph(functools.partial(run, size), pool, device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return graphs, outputs


def capture_graph(run: Callable[[], torch.Tensor], pool: tuple,
                  device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The graph of `run` in `pool`, and its output. An eager run first: Triton compiles and
    cuBLAS sets up outside the capture."""
    run()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = run()
    return graph, output
