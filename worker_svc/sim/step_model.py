"""A step's time on the simulated GPU from the kernels the real model code launches for it.

The forward and the logits + greedy sampling are traced once per model (worker_svc/sim/trace.py)
at two sizes: every op's shapes are affine in the token count (or the logits rows), so its bytes
and FLOPs are too, and the two traces give any step's ops without tracing it. Each op is priced
by its class (worker_svc/sim/calibration.py); attention is priced from the step's own context
lengths, launched as the Triton backend launches it.

An eager step is a stream: the host issues each kernel eager_launch_s after the one before, and
the GPU runs each when both it and the kernel before are done, so a step of many small kernels
takes the host's time, not the GPU's. A step that fits a CUDA-graph bucket (the real runner's
rule, worker_svc/graph_buckets.py: decode-only steps by batch size, mixed steps by tokens) runs
its forward as one graph, padded as the runner pads it, graph_node_s between nodes; the logits
and sampling after it stay eager, as in the real runner.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from pagedserve.worker_svc.graph_buckets import GraphBucket, GraphBuckets, graph_bucket
from pagedserve.worker_svc.sim.calibration import H100_CALIBRATION, Calibration
from pagedserve.worker_svc.sim.roofline import Roofline
from pagedserve.worker_svc.sim.trace import KernelOp, MetaModel

logger = logging.getLogger(__name__)

# kernels/triton_ops.py: a decode whose context passes this takes the split-KV kernels, in a
# batch of fewer (sequence, KV head) programs than the other
DECODE_PARTITION_SIZE = 512
SPLIT_KV_MAX_PROGRAMS = 512
_TRACE_SIZES = (16, 32)
_MAX_CACHED_PRICES = 4096


@dataclass(frozen=True, slots=True)
class AffineOps:
    """A traced section's kernels; op i moves bytes0[i] + n * bytes1[i] bytes at size n."""

    names: tuple[str, ...]
    op_classes: tuple[str, ...]
    bytes0: np.ndarray  # [num_ops] float64, likewise the others
    bytes1: np.ndarray
    flops0: np.ndarray
    flops1: np.ndarray

    @classmethod
    def fit(cls, small: list[KernelOp], large: list[KernelOp], n_small: int,
            n_large: int) -> AffineOps:
        names = tuple(op.name for op in large)
        op_classes = tuple(op.op_class for op in large)
        if tuple(op.name for op in small) != names:
            raise ValueError(f"the traces at {n_small} and {n_large} tokens launch different "
                             "ops; the step model needs one op sequence for every size")

        def line(values: str) -> tuple[np.ndarray, np.ndarray]:
            a = np.array([getattr(op, values) for op in small])
            b = np.array([getattr(op, values) for op in large])
            slope = (b - a) / (n_large - n_small)
            return a - slope * n_small, slope
        return cls(names, op_classes, *line("bytes"), *line("flops"))

    def at(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return self.bytes0 + n * self.bytes1, self.flops0 + n * self.flops1


@dataclass(frozen=True, slots=True)
class StepCost:
    device_s: float  # from the step's first launch to the end of its last kernel
    host_s: float  # host time spent launching
    kernel_s: float  # the kernels' own time: a profiler's GPU time
    num_launches: int  # host launches (a graph is one)
    num_kernels: int  # kernels that ran, graph nodes included
    is_graph: bool
    roofline_floor_s: float  # the bound: all FLOPs at peak or all bytes at peak bandwidth


_TRACES: dict[str, tuple[AffineOps, AffineOps]] = {}


def traced_ops(hf_config: Any, dtype: torch.dtype, enable_fused_kernels: bool = True
               ) -> tuple[AffineOps, AffineOps]:
    """(forward ops by token count, logits + sampling ops by row count), traced once per
    model config, dtype and layer code in a process (`MetaModel.build`)."""
    key = f"{dtype}:{enable_fused_kernels}:{sorted(vars(hf_config).items())!r}"
    if key not in _TRACES:
        _TRACES[key] = trace_ops(MetaModel.build(
            hf_config, dtype, enable_fused_kernels=enable_fused_kernels))
    return _TRACES[key]


def trace_ops(meta_model: MetaModel) -> tuple[AffineOps, AffineOps]:
    a, b = _TRACE_SIZES
    forward = AffineOps.fit(meta_model.trace_forward(a), meta_model.trace_forward(b), a, b)
    logits = AffineOps.fit(meta_model.trace_logits(b, a), meta_model.trace_logits(b, b), a, b)
    logger.info("simulated step: %d kernels in a forward, %d for logits and sampling",
                len(forward.names), len(logits.names))
    return forward, logits


class StepModel:
    """`floor`: the roofline of the same shapes (peak numbers, no overhead)."""

    def __init__(self, ops: tuple[AffineOps, AffineOps], floor: Roofline,
                 calibration: Calibration = H100_CALIBRATION,
                 graph_buckets: GraphBuckets | None = None) -> None:
        self.forward, self.logits = ops
        self.floor = floor
        self.gpu = floor.gpu
        self.calibration = calibration
        self.graph_buckets = graph_buckets
        shape = floor.model
        head_bytes = shape.head_size * floor.dtype_bytes
        self._kv_token_bytes = 2 * shape.num_kv_heads * head_bytes  # one layer's K and V
        self._num_kv_heads = shape.num_kv_heads
        self._q_token_bytes = shape.num_heads * head_bytes
        self._head_flops = 4 * shape.num_heads * shape.head_size
        self._attention_ops = np.array([c == "attention" for c in self.forward.op_classes])
        self._forward_class_costs = self._class_costs(self.forward.op_classes)
        self._logits_class_costs = self._class_costs(self.logits.op_classes)
        self._prices: dict[tuple[bool, int], np.ndarray] = {}

    def _class_costs(self, op_classes: tuple[str, ...]) -> tuple[np.ndarray, ...]:
        costs = [self.calibration.op_classes[c] for c in op_classes]
        return (np.array([c.fixed_s for c in costs]),
                np.array([self.gpu.memory_bandwidth * c.bandwidth_efficiency for c in costs]),
                np.array([self.gpu.peak_flops * c.flops_efficiency for c in costs]))

    def graph_bucket(self, query_lens: list[int], context_lens: list[int]) -> GraphBucket | None:
        """The runner's rule (a decode here: one new token, as the runner's step without a
        prefill among its sequences)."""
        if self.graph_buckets is None or not query_lens:
            return None
        return graph_bucket(self.graph_buckets, len(query_lens), sum(query_lens),
                            all(q == 1 for q in query_lens),
                            max(q + c for q, c in zip(query_lens, context_lens, strict=True)))

    def step(self, query_lens: list[int], context_lens: list[int],
             num_logits_rows: int) -> StepCost:
        floor = self.floor.step(query_lens, context_lens, num_logits_rows).time_s
        bucket = self.graph_bucket(query_lens, context_lens)
        if bucket is not None:
            query_lens, context_lens = _padded(bucket, query_lens, context_lens)
        num_tokens = sum(query_lens)
        forward_s = self._price(is_forward=True, n=num_tokens).copy()
        attention_s, attention_launches = self._attention(
            query_lens, context_lens, is_unified_only=bucket is not None and bucket.is_mixed)
        forward_s[self._attention_ops] = attention_s
        forward_launches = np.where(self._attention_ops, attention_launches, 1)
        # a chunk that samples nothing launches no logits kernels (cuBLAS skips an empty GEMM)
        tail_s = (self._price(is_forward=False, n=num_logits_rows) if num_logits_rows
                  else np.empty(0))
        c = self.calibration
        tail_issue = np.arange(1, len(tail_s) + 1) * c.eager_launch_s
        if bucket is None:
            issue = np.cumsum(forward_launches) * c.eager_launch_s
            durations = np.concatenate([forward_s, tail_s])
            issue = np.concatenate([issue, issue[-1] + tail_issue])
            num_launches = int(forward_launches.sum()) + len(tail_s)
        else:
            num_nodes = int(forward_launches.sum())
            graph_s = float(forward_s.sum()) + num_nodes * c.graph_node_s
            durations = np.concatenate([[graph_s], tail_s])
            issue = np.concatenate([[c.graph_launch_s], c.graph_launch_s + tail_issue])
            num_launches = 1 + len(tail_s)
        return StepCost(
            device_s=stream_end_s(issue, durations), host_s=float(issue[-1]),
            kernel_s=float(forward_s.sum() + tail_s.sum()), num_launches=num_launches,
            num_kernels=int(forward_launches.sum()) + len(tail_s),
            is_graph=bucket is not None, roofline_floor_s=floor)

    def _price(self, is_forward: bool, n: int) -> np.ndarray:
        """Each traced kernel's time at size n; the forward's attention ops are placeholders."""
        prices = self._prices.get((is_forward, n))
        if prices is None:
            ops = self.forward if is_forward else self.logits
            fixed, bandwidth, flops_rate = (self._forward_class_costs if is_forward
                                            else self._logits_class_costs)
            num_bytes, flops = ops.at(n)
            prices = fixed + np.maximum(num_bytes / bandwidth, flops / flops_rate)
            if len(self._prices) < _MAX_CACHED_PRICES:
                self._prices[is_forward, n] = prices
        return prices

    def _attention(self, query_lens: list[int], context_lens: list[int],
                   is_unified_only: bool) -> tuple[float, int]:
        """One layer's paged_attention: its time and its launches (triton_ops' launch plan; a
        mixed graph's is the unified kernel alone)."""
        q = np.array(query_lens, dtype=np.float64)
        ctx = np.array(context_lens, dtype=np.float64)
        attended = float((q * ctx + q * (q + 1) / 2).sum())
        num_bytes = ((ctx + q).sum() * self._kv_token_bytes
                     + 2 * q.sum() * self._q_token_bytes)
        is_decode = q == 1
        is_split = (not is_unified_only and bool(is_decode.any())
                    and float((ctx + q)[is_decode].max()) > DECODE_PARTITION_SIZE
                    and int(is_decode.sum()) * self._num_kv_heads < SPLIT_KV_MAX_PROGRAMS)
        num_launches = (2 if is_split else 0) + int((~is_decode).any() or not is_split)
        cost = self.calibration.op_classes["attention"]
        time_s = num_launches * cost.fixed_s + max(
            num_bytes / (self.gpu.memory_bandwidth * cost.bandwidth_efficiency),
            self._head_flops * attended / (self.gpu.peak_flops * cost.flops_efficiency))
        return time_s, num_launches


def stream_end_s(issue: np.ndarray, durations: np.ndarray) -> float:
    """When the last of one stream's kernels ends, kernel i issued at issue[i]: kernel i ends
    at max over j <= i of (issue_j + the durations j..i)."""
    return float((issue + np.cumsum(durations[::-1])[::-1]).max())


def eager_stream_s(durations: np.ndarray, launch_s: float) -> float:
    """An eager stream whose host launches one kernel every launch_s."""
    return stream_end_s(np.arange(1, len(durations) + 1) * launch_s, durations)


def _padded(bucket: GraphBucket, query_lens: list[int],
            context_lens: list[int]) -> tuple[list[int], list[int]]:
    """The step as its graph runs it: a decode graph's padding rows attend to one key each; a
    mixed graph's padding tokens are one sequence's prompt."""
    if not bucket.is_mixed:
        pad = bucket.size - len(query_lens)
        return query_lens + [1] * pad, context_lens + [0] * pad
    pad = bucket.size - sum(query_lens)
    return (query_lens + [pad], context_lens + [0]) if pad else (query_lens, context_lens)
