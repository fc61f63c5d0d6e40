"""OPT decoders, with optional project_in/out and pre- or post-norm layers (OPT-350m is post-norm)."""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import Any

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker_svc.layers.activation import get_activation
from pagedserve.worker_svc.layers.attention import Attention
from pagedserve.worker_svc.layers.linear import (
    ColumnParallelLinear,
    Linear,
    QKVLinear,
    RowParallelLinear,
    VocabEmbedding,
)
from pagedserve.worker_svc.loader import load_named_weights
from pagedserve.worker_svc.parallel import SINGLE, TensorParallel
from torch import nn

# OPT's learned position table is 2 rows longer: position p reads row p + 2 (a fairseq legacy)
POSITION_OFFSET = 2


class OPTAttention(nn.Module):
    def __init__(self, config: Any, backend: ModuleType, tp: TensorParallel) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        num_heads = config.num_attention_heads
        head_size = embed_dim // num_heads
        bias = bool(getattr(config, "enable_bias", True))
        self.qkv_proj = QKVLinear(embed_dim, head_size, num_heads, num_heads, bias=bias, tp=tp)
        self.out_proj = RowParallelLinear(embed_dim, embed_dim, bias=bias, tp=tp)
        num_heads = tp.shard(num_heads, "num_attention_heads")  # on this rank
        self.attn = Attention(num_heads, head_size, num_heads, head_size ** -0.5, backend)

    def forward(self, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden_states)
        return self.out_proj(self.attn(q, k, v, kv_cache, meta))


class OPTDecoderLayer(nn.Module):
    def __init__(self, config: Any, backend: ModuleType, tp: TensorParallel) -> None:
        super().__init__()
        embed_dim = config.hidden_size
        bias = bool(getattr(config, "enable_bias", True))
        affine = bool(getattr(config, "layer_norm_elementwise_affine", True))
        self.do_layer_norm_before = config.do_layer_norm_before
        self.self_attn = OPTAttention(config, backend, tp)
        self.self_attn_layer_norm = nn.LayerNorm(embed_dim, elementwise_affine=affine)
        self.fc1 = ColumnParallelLinear(embed_dim, config.ffn_dim, bias=bias, tp=tp)
        self.activation_fn = get_activation(config.activation_function)
        self.fc2 = RowParallelLinear(config.ffn_dim, embed_dim, bias=bias, tp=tp)
        self.final_layer_norm = nn.LayerNorm(embed_dim, elementwise_affine=affine)

    def forward(self, hidden_states: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, kv_cache, meta)
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = residual + self.fc2(self.activation_fn(self.fc1(hidden_states)))
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        return hidden_states


class OPTDecoder(nn.Module):
    def __init__(self, config: Any, max_position: int, backend: ModuleType,
                 tp: TensorParallel) -> None:
        super().__init__()
        proj_dim = config.word_embed_proj_dim
        self.embed_tokens = VocabEmbedding(config.vocab_size, proj_dim, tp)
        num_positions = max(config.max_position_embeddings, max_position)
        self.embed_positions = VocabEmbedding(num_positions + POSITION_OFFSET, config.hidden_size)
        needs_projection = proj_dim != config.hidden_size
        self.project_in = Linear(proj_dim, config.hidden_size) if needs_projection else None
        self.project_out = Linear(config.hidden_size, proj_dim) if needs_projection else None
        has_final_norm = (config.do_layer_norm_before
                          and not getattr(config, "_remove_final_layer_norm", False))
        self.final_layer_norm = (
            nn.LayerNorm(config.hidden_size,
                         elementwise_affine=getattr(config, "layer_norm_elementwise_affine", True))
            if has_final_norm else None)
        self.layers = nn.ModuleList(
            OPTDecoderLayer(config, backend, tp) for _ in range(config.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        inputs_embeds = self.embed_tokens(input_ids)  # [num_tokens, word_embed_proj_dim]
        if self.project_in is not None:
            inputs_embeds = self.project_in(inputs_embeds)
        hidden_states = inputs_embeds + self.embed_positions(positions + POSITION_OFFSET)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden_states = layer(hidden_states, kv_cache, meta)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        if self.project_out is not None:
            hidden_states = self.project_out(hidden_states)
        return hidden_states


class OPTModel(nn.Module):
    def __init__(self, config: Any, max_position: int, backend: ModuleType,
                 tp: TensorParallel) -> None:
        super().__init__()
        self.decoder = OPTDecoder(config, max_position, backend, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        return self.decoder(input_ids, positions, kv_caches, meta)


class OPTForCausalLM(nn.Module):
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
    ]

    def __init__(self, config: Any, backend: ModuleType, max_position: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.config = config
        self.model = OPTModel(config, max_position, backend, tp)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        if self.tie_word_embeddings:
            self.lm_head = self.model.decoder.embed_tokens
        else:
            self.lm_head = VocabEmbedding(config.vocab_size, config.word_embed_proj_dim, tp)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [num_tokens] → [num_tokens, word_embed_proj_dim]"""
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, word_embed_proj_dim] → float32 [num_rows, vocab_size]; None on ranks > 0."""
        return self.lm_head.lm_logits(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        def renamed() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                # early OPT checkpoints name their tensors "decoder.…" without the "model." prefix
                yield (f"model.{name}" if name.startswith("decoder.") else name), tensor

        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        return load_named_weights(self, renamed(), self.stacked_params_mapping, skip)
