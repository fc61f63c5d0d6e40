"""Llama-family decoders: Llama 2/3 (and Mistral-style checkpoints saved as Llama), Qwen2 (q/k/v
bias) and Qwen3 (per-head RMSNorm on q and k). One implementation, a `LlamaVariant` per
architecture; vLLM's structure: ForCausalLM → Model → DecoderLayer → Attention + MLP."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.errors import ConfigError
from pagedserve.worker_svc.layers.activation import SiluAndMul
from pagedserve.worker_svc.layers.attention import Attention
from pagedserve.worker_svc.layers.linear import (
    MergedLinear,
    QKVLinear,
    RowParallelLinear,
    VocabEmbedding,
    kv_heads_of_rank,
)
from pagedserve.worker_svc.layers.norm import RMSNorm
from pagedserve.worker_svc.layers.rotary import RotaryEmbedding, rope_settings
from pagedserve.worker_svc.loader import load_named_weights
from pagedserve.worker_svc.parallel import SINGLE, TensorParallel
from torch import nn


@dataclass(frozen=True, slots=True)
class LlamaVariant:
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool,
                 tp: TensorParallel) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise ConfigError(f"hidden_act must be 'silu' for this architecture, got {hidden_act!r}")
        self.gate_up_proj = MergedLinear(hidden_size, {0: intermediate_size, 1: intermediate_size},
                                         bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp=tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: Any, variant: LlamaVariant, rotary_emb: RotaryEmbedding,
                 backend: ModuleType, tp: TensorParallel) -> None:
        super().__init__()
        hidden_size = config.hidden_size
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_size = getattr(config, "head_dim", None) or hidden_size // num_heads
        self.qkv_proj = QKVLinear(hidden_size, self.head_size, num_heads, num_kv_heads,
                                  bias=variant.qkv_bias, tp=tp)
        self.o_proj = RowParallelLinear(num_heads * self.head_size, hidden_size,
                                        bias=variant.o_bias, tp=tp)
        self.num_heads = tp.shard(num_heads, "num_attention_heads")  # on this rank
        self.num_kv_heads = kv_heads_of_rank(num_kv_heads, tp)[1]
        if variant.qk_norm:
            self.q_norm = RMSNorm(self.head_size, eps=config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_size, eps=config.rms_norm_eps)
        self.has_qk_norm = variant.qk_norm
        self.attn = Attention(self.num_heads, self.head_size, self.num_kv_heads,
                              self.head_size ** -0.5, backend, rotary_emb)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states)  # [num_tokens, q_size], [num_tokens, kv_size] ×2
        qk_norm = (self.q_norm, self.k_norm) if self.has_qk_norm else None
        return self.o_proj(self.attn(q, k, v, kv_cache, meta, positions, qk_norm))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: Any, variant: LlamaVariant, rotary_emb: RotaryEmbedding,
                 backend: ModuleType, tp: TensorParallel) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, variant, rotary_emb, backend, tp)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                            variant.mlp_bias, tp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None, kv_cache: torch.Tensor, meta: AttentionMetadata
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, meta)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: Any, variant: LlamaVariant, max_position: int,
                 backend: ModuleType, tp: TensorParallel) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, tp)
        # one table for every layer, as they turn by the same positions (a table per layer was
        # num_layers x max_position x head_size floats: 128 MB for Llama-3-8B)
        head_size = (getattr(config, "head_dim", None)
                     or config.hidden_size // config.num_attention_heads)
        rotary_emb = RotaryEmbedding(head_size, max_position, *rope_settings(config))
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, variant, rotary_emb, backend, tp)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        hidden_states = self.embed_tokens(input_ids)  # [num_tokens, hidden]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, meta)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config: Any, backend: ModuleType, max_position: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.variant(config), max_position, backend, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = VocabEmbedding(config.vocab_size, config.hidden_size, tp)

    @staticmethod
    def variant(config: Any) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias,
                            mlp_bias=bool(getattr(config, "mlp_bias", False)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] → [num_tokens, hidden]"""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, hidden] → float32 [num_rows, vocab_size]; None on ranks > 0."""
        return self.lm_head.lm_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        return load_named_weights(self, weights, self.stacked_params_mapping, skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def variant(config: Any) -> LlamaVariant:
        return LlamaVariant(qkv_bias=True)


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def variant(config: Any) -> LlamaVariant:
        bias = bool(getattr(config, "attention_bias", False))
        return LlamaVariant(qkv_bias=bias, o_bias=bias, qk_norm=True)
