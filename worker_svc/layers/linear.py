"""Linear layers whose parameters start empty (the loader fills every one) and know how to take
their checkpoint shards: q/k/v stack into one qkv_proj, gate/up into one gate_up_proj, so a layer
runs one matmul where the checkpoint has three or two."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    if param.shape != loaded_weight.shape:
        raise ValueError(f"weight shape mismatch: parameter {tuple(param.shape)}, "
                         f"checkpoint {tuple(loaded_weight.shape)}")
    param.data.copy_(loaded_weight)


class Linear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        self.weight = nn.Parameter(torch.empty(output_size, input_size), requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(output_size), requires_grad=False)
                     if bias else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Projections of one input stacked along the output dimension, in `shard_sizes` order.

    `shard_sizes` maps the checkpoint's shard id ("q", "k", "v" or 0, 1) to its output size.
    """

    def __init__(self, input_size: int, shard_sizes: dict[str | int, int], bias: bool = False
                 ) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: str | int) -> None:
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size), loaded_weight)


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False) -> None:
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        super().__init__(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                         bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] → q [num_tokens, q_size], k, v [num_tokens, kv_size]."""
        return super().forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
