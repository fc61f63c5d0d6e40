"""A roofline model of one engine step on a named GPU: its FLOPs at peak FLOP/s or its bytes at
peak bandwidth, whichever takes longer, plus a fixed overhead. Activations, kernel efficiency
and overlap are left out (the calibration factors scale peak numbers down). Llama-3-8B decoding
one sequence on an H100 SXM: 15.0 GB / 3.35 TB/s = 4.5 ms (a step reads only its tokens' rows
of the embedding table).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pagedserve.services.common.errors import ConfigError

MiB = 1 << 20


@dataclass(frozen=True, slots=True)
class GpuSpec:
    name: str
    peak_flops: float  # dense bf16 tensor-core FLOP/s
    memory_bandwidth: float  # HBM/GDDR bytes/s
    memory_bytes: int  # what the driver reports as total
    host_link_bandwidth: float  # PCIe bytes/s one way (swaps)


# datasheet numbers (dense, no sparsity); memory as nvidia-smi reports it
GPUS = {g.name: g for g in (
    GpuSpec("H100-SXM", 989.4e12, 3.35e12, 81559 * MiB, 64e9),
    GpuSpec("H200", 989.4e12, 4.8e12, 143771 * MiB, 64e9),
    GpuSpec("A100-80G", 312e12, 2.039e12, 81920 * MiB, 32e9),
    GpuSpec("L4", 121e12, 300e9, 23034 * MiB, 32e9),
)}


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool = False
    has_qkv_bias: bool = False
    max_position_embeddings: int = 8192

    @property
    def layer_params(self) -> int:
        q, kv = self.num_heads * self.head_size, self.num_kv_heads * self.head_size
        return self.hidden_size * (2 * q + 2 * kv) + 3 * self.hidden_size * self.intermediate_size

    @property
    def num_params(self) -> int:
        h = self.hidden_size
        bias = (self.num_heads + 2 * self.num_kv_heads) * self.head_size if self.has_qkv_bias else 0
        per_layer = self.layer_params + 2 * h + bias
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + embeddings + h

    @property
    def params_read_per_step(self) -> int:
        """All but the input embedding table, whose rows are gathered; the lm_head is read whole
        even when tied to it."""
        embedding = 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size
        return self.num_params - embedding

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_size * dtype_bytes

    @classmethod
    def from_hf_config(cls, name: str, cfg: dict) -> ModelShape:
        try:
            num_heads = int(cfg["num_attention_heads"])
            hidden = int(cfg["hidden_size"])
            return cls(name=name, hidden_size=hidden, num_layers=int(cfg["num_hidden_layers"]),
                       num_heads=num_heads,
                       num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
                       head_size=int(cfg.get("head_dim") or hidden // num_heads),
                       intermediate_size=int(cfg["intermediate_size"]),
                       vocab_size=int(cfg["vocab_size"]),
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       has_qkv_bias=cfg.get("model_type") == "qwen2"
                       or bool(cfg.get("attention_bias", False)),
                       max_position_embeddings=int(cfg.get("max_position_embeddings", 8192)))
        except KeyError as exc:
            raise ConfigError(f"sim_model {name!r}: config.json lacks {exc.args[0]!r}") from exc


MODELS = {m.name: m for m in (
    ModelShape("Llama-3-8B", 4096, 32, 32, 8, 128, 14336, 128256),
    ModelShape("Qwen2.5-7B", 3584, 28, 28, 4, 128, 18944, 152064, has_qkv_bias=True,
               max_position_embeddings=32768),
    ModelShape("Llama-3.2-1B", 2048, 16, 32, 8, 64, 8192, 128256, tie_word_embeddings=True,
               max_position_embeddings=131072),
    ModelShape("Qwen2.5-0.5B", 896, 24, 14, 2, 64, 4864, 151936, tie_word_embeddings=True,
               has_qkv_bias=True, max_position_embeddings=32768),
    ModelShape("SmolLM2-1.7B", 2048, 24, 32, 32, 64, 8192, 49152, tie_word_embeddings=True),
)}


def resolve_gpu(name: str) -> GpuSpec:
    if name not in GPUS:
        raise ConfigError(f"sim_gpu must be one of {list(GPUS)}, got {name!r}")
    return GPUS[name]


def resolve_model_shape(name_or_path: str) -> ModelShape:
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"sim_model must be one of {list(MODELS)} or a folder with "
                          f"config.json, got {name_or_path!r}")
    return ModelShape.from_hf_config(name_or_path, json.loads(path.read_text()))


@dataclass(frozen=True, slots=True)
class StepCost:
    flops: float
    bytes: float  # weights + KV read + KV written
    compute_s: float
    memory_s: float
    time_s: float  # max(compute_s, memory_s) + overhead


@dataclass(frozen=True, slots=True)
class Roofline:
    model: ModelShape
    gpu: GpuSpec
    dtype_bytes: int = 2
    flops_efficiency: float = 1.0
    bandwidth_efficiency: float = 1.0
    overhead_s: float = 0.0

    def step(self, query_lens: list[int], context_lens: list[int],
             num_logits_rows: int) -> StepCost:
        m = self.model
        num_tokens = sum(query_lens)
        # QK^T and PV, 2 FLOPs per multiply-add: new token j of a chunk sees context + j + 1
        attended = sum(q * c + q * (q + 1) // 2 for q, c in zip(query_lens, context_lens,
                                                                  strict=True))
        lm_head = m.vocab_size * m.hidden_size
        flops = (2 * m.num_layers * m.layer_params * num_tokens + 2 * lm_head * num_logits_rows
                 + 4 * m.num_layers * m.num_heads * m.head_size * attended)
        kv_token = m.kv_bytes_per_token(self.dtype_bytes)
        kv_read = (sum(context_lens) + num_tokens) * kv_token
        weights = (m.params_read_per_step + num_tokens * m.hidden_size) * self.dtype_bytes
        num_bytes = weights + kv_read + num_tokens * kv_token
        compute_s = flops / (self.gpu.peak_flops * self.flops_efficiency)
        memory_s = num_bytes / (self.gpu.memory_bandwidth * self.bandwidth_efficiency)
        return StepCost(flops, num_bytes, compute_s, memory_s,
                        max(compute_s, memory_s) + self.overhead_s)

    def block_moves_s(self, num_swapped_blocks: int, num_copied_blocks: int,
                      block_bytes: int) -> float:
        """Swaps cross the host link; copy-on-write reads and writes device memory."""
        return (num_swapped_blocks * block_bytes / self.gpu.host_link_bandwidth
                + 2 * num_copied_blocks * block_bytes
                / (self.gpu.memory_bandwidth * self.bandwidth_efficiency))
