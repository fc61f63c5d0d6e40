from __future__ import annotations

from types import ModuleType

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from torch import nn


class Attention(nn.Module):
    def __init__(self, num_heads: int, head_size: int, num_kv_heads: int, scale: float,
                 backend: ModuleType) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads
        self.scale = scale
        self.backend = backend

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """query: [num_tokens, num_heads * head_size]; key, value: [num_tokens, num_kv_heads *
        head_size]; kv_cache: [2, num_blocks, block_size, num_kv_heads, head_size]."""
        num_tokens = query.shape[0]
        query = query.view(num_tokens, self.num_heads, self.head_size)
        key = key.view(num_tokens, self.num_kv_heads, self.head_size)
        value = value.view(num_tokens, self.num_kv_heads, self.head_size)
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        self.backend.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
        out = self.backend.paged_attention(query, k_cache, v_cache, meta, self.scale)
        return out.view(num_tokens, self.num_heads * self.head_size)
