from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch
from pagedserve.kernels import layer_ops
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.worker_svc.layers.norm import RMSNorm
from pagedserve.worker_svc.layers.rotary import RotaryEmbedding
from torch import nn


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 backend: ModuleType, rotary_emb: RotaryEmbedding | None = None) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = backend
        self.rotary_emb = rotary_emb

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata,
                positions: torch.Tensor | None = None,
                qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> torch.Tensor:
        """query: [num_tokens, num_heads * head_size] or [num_tokens, num_heads, head_size]; key,
        value: likewise with num_kv_heads; kv_cache: [2, num_blocks, block_size, num_kv_heads,
        head_size]; positions: [num_tokens], by which a rotary embedding turns query and key;
        qk_norm: per-head RMSNorms of query and key before they turn (Qwen3), in the rotary
        kernel where it is fused (both norms have the model's one rms_norm_eps)."""
        num_tokens = query.shape[0]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        rotary_write_kv = self._rotary_write_kv(query, k_cache)
        if rotary_write_kv is not None:
            norms = () if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight,
                                                qk_norm[0].eps)
            query = rotary_write_kv(positions, query, key, value, self.rotary_emb.cos_sin_cache,
                                    k_cache, v_cache, meta.slot_mapping, *norms)
        else:
            if qk_norm is not None:
                query = qk_norm[0](query.reshape(num_tokens, self.num_heads, self.head_size))
                key = qk_norm[1](key.reshape(num_tokens, self.num_kv_heads, self.head_size))
            if self.rotary_emb is not None:
                query, key = self.rotary_emb(positions, query, key)
            query = query.view(num_tokens, self.num_heads, self.head_size)
            key = key.view(num_tokens, self.num_kv_heads, self.head_size)
            value = value.view(num_tokens, self.num_kv_heads, self.head_size)
            self.backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.paged_attention(query, k_cache, v_cache, meta, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_size)

    def _rotary_write_kv(self, query: torch.Tensor, k_cache: torch.Tensor
                         ) -> Callable[..., torch.Tensor] | None:
        """The one-call rotary and K/V cache write for this step, or None for the torch code."""
        if self.rotary_emb is None:
            return None
        if self.rotary_emb.is_fused(query):
            return layer_ops.rotary_write_kv
        kernels = self.rotary_emb.cpu_kernels(query)
        if kernels is not None and query.dim() == 2 and k_cache.dtype == query.dtype:
            return kernels.rotary_write_kv
        return None
