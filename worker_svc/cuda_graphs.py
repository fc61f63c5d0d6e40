"""CUDA graphs for decode-only steps.

A decode step launches a few kernels per layer for a handful of tokens, so at small batch sizes
the launches, not the math, set the step time. Worker.warm_up captures the model forward (token
ids → hidden states) once per decode batch-size bucket; a decode-only step whose batch fits a
bucket then replays the smallest such graph instead of launching kernel by kernel.

What makes the forward replayable:
- Static inputs. Every graph reads the same preallocated buffers (token ids, positions, slot
  mapping, block tables, seq lens, query_start_loc); a step copies its values into the first
  rows and turns the rest of its bucket into padding. The KV-cache tensors are baked into the
  graphs too, so the graphs are dropped whenever the cache is replaced.
- Fixed launch geometry. Backends size their grids from the metadata's host fields
  (query_lens_cpu, seq_lens_cpu, max_seq_len). Capture metadata holds upper bounds there
  (query length 1 and seq len `max_seq_len` on every row) and the real lengths only in the
  device tensors the kernels read: the Triton kernels and flash-attn's decode stay correct for
  any real length up to those bounds (a split-KV partition past a sequence's end does nothing).
  The torch and ref backends shape their work by the host lengths and are never captured.
  Decodes longer than `max_seq_len` run eagerly.
- Harmless padding. A padding row writes no KV (slot -1) and attends to one key (seq len 1
  through block 0, a finite row of a zero-initialized cache) with token 0 at position 0; its
  hidden state is never read.

The logits projection and sampling stay outside the graph: the runner computes logits for the
rows it needs from the graph's output, exactly as it does after an eager forward.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass

import torch
from pagedserve.kernels.cdiv import cdiv
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker_svc.cache_engine import KVCacheSpec, allocate_kv_caches
from pagedserve.worker_svc.model_input import ModelInput
from torch import nn

logger = logging.getLogger(__name__)

MAX_CAPTURE_BATCH_SIZE = 256
# Bounds the graphs' split-KV scratch (it grows with the number of partitions) and their block
# tables; longer decodes are rare enough to run eagerly.
MAX_CAPTURE_SEQ_LEN = 8192
# Backends whose decode kernels need only the device seq_lens to be correct (see above).
CAPTURABLE_BACKENDS = ("triton", "flash_attn")
# Headroom the memory profile reserves beyond the measured forward, estimates rather than
# measurements: once for the capture stream's cuBLAS workspace and allocator rounding, and per
# graph for the instantiated graph and its kernel parameters.
GRAPH_BASE_HEADROOM_BYTES = 64 << 20
GRAPH_HEADROOM_BYTES = 2 << 20


def capture_batch_sizes(max_num_seqs: int) -> list[int]:
    """The decode buckets: 1, 2, 4, then multiples of 8, up to min(max_num_seqs, 256), that bound
    itself included so that every decode batch the scheduler may send fits a bucket."""
    limit = min(max_num_seqs, MAX_CAPTURE_BATCH_SIZE)
    sizes = [s for s in (1, 2, 4) if s < limit] + list(range(8, limit, 8))
    return [*sizes, limit]


def pick_batch_size(num_seqs: int, batch_sizes: list[int]) -> int | None:
    """The smallest bucket holding num_seqs rows (batch_sizes ascending); None if none does."""
    i = bisect.bisect_left(batch_sizes, num_seqs)
    return batch_sizes[i] if i < len(batch_sizes) else None


def decode_batch_size(meta: AttentionMetadata, batch_sizes: list[int],
                      max_seq_len: int) -> int | None:
    """The bucket a step replays in, or None when it must run eagerly: it holds a prefill (more
    than one token of some sequence), a sequence longer than the graphs' bound, or more
    sequences than the largest bucket."""
    if meta.num_prefills or meta.max_query_len != 1 or meta.max_seq_len > max_seq_len:
        return None
    return pick_batch_size(meta.num_seqs, batch_sizes)


@dataclass(slots=True)
class DecodeBuffers:
    """The graphs' inputs. A bucket of B rows reads the first B rows of each buffer."""

    input_ids: torch.Tensor  # [max_batch_size] int64
    positions: torch.Tensor  # [max_batch_size] int64
    slot_mapping: torch.Tensor  # [max_batch_size] int64
    block_tables: torch.Tensor  # [max_batch_size, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [max_batch_size] int32
    query_start_loc: torch.Tensor  # [max_batch_size + 1] int32: 0, 1, 2, ... (one token each)

    @classmethod
    def allocate(cls, max_batch_size: int, max_blocks_per_seq: int,
                 device: torch.device) -> DecodeBuffers:
        """Every row starts as padding."""
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
        """Copy a decode-only step's inputs into the first rows; its other rows up to batch_size
        become padding. Device-to-device copies only: nothing waits for the host."""
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
        self.input_ids[n:batch_size].zero_()
        self.positions[n:batch_size].zero_()
        self.slot_mapping[n:batch_size].fill_(-1)
        self.seq_lens[n:batch_size].fill_(1)
        self.block_tables[n:batch_size].zero_()

    def metadata(self, batch_size: int, max_seq_len: int) -> AttentionMetadata:
        """Metadata over the first batch_size rows, host fields at their upper bounds."""
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
    """One captured forward per decode bucket, all over the same buffers and KV cache."""

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
        """The forward a graph records: the model over the buffers' first batch_size rows.
        Returns hidden states [batch_size, hidden]."""
        buffers = self.buffers
        return self.model(buffers.input_ids[:batch_size], buffers.positions[:batch_size],
                          kv_caches, buffers.metadata(batch_size, self.max_seq_len))

    @torch.inference_mode()
    def capture(self, kv_caches: list[torch.Tensor]) -> None:
        """Capture every bucket on `kv_caches`, largest first: all graphs share one memory pool,
        and the smaller ones fit into what the largest one left. The buffers hold padding rows
        only, so capturing writes nothing into the cache."""
        pool = torch.cuda.graph_pool_handle()
        for batch_size in reversed(self.batch_sizes):
            # an eager run first: Triton compiles and cuBLAS sets up outside the capture
            self.run_static(batch_size, kv_caches)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden_states[batch_size] = self.run_static(batch_size, kv_caches)
            self.graphs[batch_size] = graph
        self.kv_caches = kv_caches
        torch.cuda.synchronize(self.device)
        # the warm-up runs' activations go back, so what stays reserved is the graphs'
        torch.cuda.empty_cache()
        logger.info("captured %d decode CUDA graphs (batch sizes %s, seq len up to %d)",
                    len(self.graphs), self.batch_sizes, self.max_seq_len)

    def batch_size_for(self, model_input: ModelInput,
                       kv_caches: list[torch.Tensor]) -> int | None:
        """The bucket this step replays in, or None to run it eagerly."""
        if kv_caches is not self.kv_caches:
            return None
        return decode_batch_size(model_input.meta, self.batch_sizes, self.max_seq_len)

    def replay(self, model_input: ModelInput, batch_size: int) -> torch.Tensor:
        """Hidden states of the step's rows, [num_tokens, hidden]: a view of the graph's output,
        valid until the next replay."""
        self.buffers.load(model_input, batch_size)
        self.graphs[batch_size].replay()
        self.num_replays += 1
        return self.hidden_states[batch_size][:model_input.num_tokens]


@torch.inference_mode()
def graph_memory_bytes(model: nn.Module, spec: KVCacheSpec, batch_sizes: list[int],
                       max_seq_len: int, device: torch.device) -> int:
    """What capturing `batch_sizes` will hold on the device, measured before the cache exists:
    the peak of one eager padded forward at the largest bucket (the shared pool's size, since
    the smaller graphs reuse it), every graph's output, and the headroom above."""
    largest = max(batch_sizes)
    graphs = DecodeGraphs(model, batch_sizes, max_seq_len, spec.block_size, device)
    kv_caches = allocate_kv_caches(spec, 1, device)  # padding rows read block 0 only
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    hidden_states = graphs.run_static(largest, kv_caches)  # [largest, hidden]
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - baseline
    row_bytes = hidden_states.shape[1] * hidden_states.element_size()
    del graphs, kv_caches, hidden_states
    torch.cuda.empty_cache()
    return (peak + sum(batch_sizes) * row_bytes + GRAPH_BASE_HEADROOM_BYTES
            + len(batch_sizes) * GRAPH_HEADROOM_BYTES)
