"""The kernels a step of the real model code would launch: the model classes of
worker_svc/models, built on the meta device (no weights allocated), run one forward under a
dispatch mode that records every aten op with its shapes, and the logits and greedy sampling
after it. On meta the layers take their GPU path: each fused kernel of kernels.layer_ops is one
custom op, so one recorded op. Attention goes through a recording backend: one paged_attention op
per layer (and a write_kv where the rotary kernel does not write the cache), priced later from
the step's context lengths (the KV they read), not traced into.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.layers.fused import disable_fused_kernels
from pagedserve.worker_svc.loader import default_dtype, load_hf_config
from pagedserve.worker_svc.models.registry import get_model_class
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState
from pagedserve.worker_svc.sim.roofline import MODELS, ModelShape
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

META = torch.device("meta")

GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm"})
REDUCTION_OPS = frozenset({"mean", "sum", "amax", "amin", "max", "min", "argmax", "argmin",
                           "_softmax", "_log_softmax", "logsumexp", "topk", "sort", "cumsum",
                           "var_mean", "prod", "native_layer_norm"})
GATHER_OPS = frozenset({"index", "index_select", "embedding", "gather", "_unsafe_index"})
SCATTER_OPS = frozenset({"index_put", "index_put_", "scatter", "scatter_", "_index_put_impl_"})
# kernels.layer_ops: one Triton kernel each (the rotary one also writes the K/V cache)
LAYER_OPS = {"pagedserve::rms_norm": "fused", "pagedserve::fused_add_rms_norm": "fused",
             "pagedserve::silu_and_mul": "fused", "pagedserve::rotary_write_kv": "kv_write"}
NO_KERNEL_OPS = frozenset({"empty", "empty_like", "empty_strided", "new_empty",
                           "new_empty_strided", "detach", "detach_", "alias", "lift_fresh",
                           "_local_scalar_dense"})


@dataclass(frozen=True, slots=True)
class KernelOp:
    """One kernel launch: its op class (how it is priced) and the work its shapes imply."""

    name: str  # aten op, or "write_kv" / "paged_attention"
    op_class: str  # gemm, attention, kv_write, fused, elementwise, strided, reduction, cat,
    # gather, scatter
    flops: float
    bytes: float  # read + written


def _bytes_read(t: torch.Tensor) -> int:
    """Elements a kernel reads once each: an expanded (stride 0) dim is read once."""
    n = 1
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if stride != 0:
            n *= size
    return n * t.element_size()


def _tensors(tree: Any) -> list[torch.Tensor]:
    leaves, _ = torch.utils._pytree.tree_flatten(tree)
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def classify(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> str:
    if name in LAYER_OPS:
        return LAYER_OPS[name]
    if name in GEMM_OPS:
        return "gemm"
    if name in REDUCTION_OPS:
        return "reduction"
    if name in GATHER_OPS:
        return "gather"
    if name in SCATTER_OPS:
        return "scatter"
    if name == "cat":
        return "cat"
    out = outputs[0]
    is_cast = name in ("_to_copy", "copy_")
    # a contiguous, same-shape elementwise op (a cast included) runs PyTorch's vectorized
    # kernel; a broadcast, strided or mixed-dtype operand takes the slower generic one
    is_plain = all(t.is_contiguous() and t.shape == out.shape and (is_cast or t.dtype == out.dtype)
                   for t in inputs if t.dim() > 0) and out.is_contiguous()
    return "elementwise" if is_plain else "strided"


def _flops(name: str, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> float:
    if name in GEMM_OPS:
        a, b = inputs[-2], inputs[-1]
        return 2.0 * a.numel() * b.shape[-1]
    if name in REDUCTION_OPS:
        return float(inputs[0].numel())
    return float(sum(t.numel() for t in outputs))


def _rotary_write_kv_bytes(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           *qk_norm: Any) -> tuple[int, int]:
    """(bytes read, bytes written to the cache): one table row per token, not the table;
    qk_norm: the q/k norm weights (and eps) where the kernel normalizes the heads too."""
    row_bytes = cos_sin_cache.shape[1] * cos_sin_cache.element_size()
    read = (sum(map(_bytes_read, (positions, query, key, value, slot_mapping, *_tensors(qk_norm))))
            + positions.numel() * row_bytes)
    return read, _bytes_read(key) + _bytes_read(value)


class OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[KernelOp] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        name = func._schema.name.removeprefix("aten::")
        if func.is_view or name in NO_KERNEL_OPS:
            return out
        inputs, outputs = _tensors((args, kwargs)), _tensors(out)
        if not outputs or all(t.numel() == 0 for t in outputs):
            return out
        op_class = classify(name, inputs, outputs)
        written = sum(t.numel() * t.element_size() for t in outputs)
        if op_class == "gather":  # reads the rows it writes and the indices, not the table
            read = written + sum(_bytes_read(t) for t in inputs if not t.is_floating_point())
        elif name == "pagedserve::rotary_write_kv":
            read, cache_written = _rotary_write_kv_bytes(*args, *(kwargs or {}).values())
            written += cache_written
        else:
            read = sum(map(_bytes_read, inputs))
        self.ops.append(KernelOp(name, op_class, _flops(name, inputs, outputs),
                                 float(read + written)))
        return out


class RecordingBackend:
    """The kernels module a model calls for attention, recording instead of launching.
    `paged_attention`'s bytes and FLOPs are left at 0: they depend on the step's context
    lengths, which the step model knows and the trace does not."""

    def __init__(self, recorder: OpRecorder) -> None:
        self.recorder = recorder

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        moved = 2 * (key.numel() * key.element_size() + value.numel() * value.element_size())
        self.recorder.ops.append(KernelOp("write_kv", "kv_write", 0.0, float(moved)))

    def paged_attention(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.recorder.ops.append(KernelOp("paged_attention", "attention", 0.0, 0.0))
        return torch.empty_like(query)


def hf_config_of(shape: ModelShape) -> SimpleNamespace:
    """The config attributes the model classes read, for a shape without its config.json."""
    architecture = "Qwen2ForCausalLM" if shape.has_qkv_bias else "LlamaForCausalLM"
    return SimpleNamespace(
        architectures=[architecture], hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_size,
        intermediate_size=shape.intermediate_size, vocab_size=shape.vocab_size,
        tie_word_embeddings=shape.tie_word_embeddings, hidden_act="silu", rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=shape.max_position_embeddings,
        attention_bias=False, mlp_bias=False)


def sim_hf_config(sim_model: str) -> Any:
    """The config whose model class is traced: a preset's shapes, or a folder's config.json."""
    if sim_model in MODELS:
        return hf_config_of(MODELS[sim_model])
    return load_hf_config(sim_model)


@dataclass(slots=True)
class MetaModel:
    """The real model class on the meta device, with a recording attention backend."""

    model: nn.Module
    recorder: OpRecorder
    num_layers: int
    num_kv_heads: int
    head_size: int
    vocab_size: int
    dtype: torch.dtype

    @classmethod
    def build(cls, hf_config: Any, dtype: torch.dtype, model_class: type[nn.Module] | None = None,
              enable_fused_kernels: bool = True) -> MetaModel:
        """enable_fused_kernels off: the layers' torch code, as a GPU ran it before the fused
        kernels (the code the calibration was measured on)."""
        recorder = OpRecorder()
        model_class = model_class or get_model_class(list(hf_config.architectures))
        # the rotary table is sized by the positions a step may reach; on meta it costs nothing
        max_position = int(hf_config.max_position_embeddings)
        with default_dtype(dtype), META:
            model = model_class(hf_config, backend=RecordingBackend(recorder),
                                max_position=max_position)
        if not enable_fused_kernels:
            disable_fused_kernels(model)
        num_heads = int(hf_config.num_attention_heads)
        head_size = int(getattr(hf_config, "head_dim", None)
                        or hf_config.hidden_size // num_heads)
        num_kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or num_heads)
        return cls(model.eval(), recorder, int(hf_config.num_hidden_layers), num_kv_heads,
                   head_size, int(hf_config.vocab_size), dtype)

    @torch.no_grad()
    def trace_forward(self, num_tokens: int) -> list[KernelOp]:
        """The ops of a forward over num_tokens tokens (any mix of prefill and decode: the
        shapes outside attention depend only on the token count)."""
        ids = torch.zeros(num_tokens, dtype=torch.long, device=META)
        kv_cache = torch.empty(2, 1, 16, self.num_kv_heads, self.head_size, dtype=self.dtype,
                               device=META)
        meta = AttentionMetadata(
            slot_mapping=ids, block_tables=torch.zeros(1, 1, dtype=torch.int32, device=META),
            seq_lens=torch.zeros(1, dtype=torch.int32, device=META),
            query_start_loc=torch.zeros(2, dtype=torch.int32, device=META),
            max_query_len=num_tokens, max_seq_len=num_tokens, num_prefills=1,
            num_prefill_tokens=num_tokens, query_lens_cpu=[num_tokens],
            seq_lens_cpu=[num_tokens])
        return self._record(lambda: self.model(ids, ids, [kv_cache] * self.num_layers, meta))

    @torch.no_grad()
    def trace_logits(self, num_tokens: int, num_rows: int, sample: bool = True
                     ) -> list[KernelOp]:
        """The rows' hidden states picked (unless every token is a row), the logits, and greedy
        sampling with logprobs of the drawn tokens (the sampler's fast path); sample off: up to
        the float32 logits, the end of a GPU worker's timed forward."""
        hidden = torch.empty(num_tokens, self.model.config.hidden_size, dtype=self.dtype,
                             device=META)
        # the worker picks rows only when not every token is one (ModelRunner._forward)
        picked = hidden if num_rows == num_tokens else hidden[
            torch.zeros(num_rows, dtype=torch.long, device=META)]
        if not sample:
            return self._record(lambda: self.model.compute_logits(picked))
        sampler = Sampler(self.vocab_size, [], torch.device("cpu"))
        sampler.device = META  # its generator stays on the host: greedy rows never draw
        seqs = [SeqSamplingState(seq_id=i, sampling=SamplingParams(temperature=0.0), token_ids=[0], prompt_len=1,
                                 seed=None, num_samples=1) for i in range(num_rows)]
        return self._record(lambda: sampler.launch(self.model.compute_logits(picked), seqs))

    def _record(self, run: Any) -> list[KernelOp]:
        self.recorder.ops = []
        with self.recorder:
            run()
        return self.recorder.ops
