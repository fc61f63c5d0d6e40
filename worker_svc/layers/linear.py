"""Linear layers whose parameters start empty (the loader fills every one) and know how to take
their checkpoint shards: q/k/v stack into one qkv_proj, gate/up into one gate_up_proj, so a layer
runs one matmul where the checkpoint has three or two. Under tensor parallelism
(worker_svc/parallel.py) the column-parallel ones keep this rank's output slice and the
row-parallel ones its input slice, all-reducing their output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker_svc.parallel import SINGLE, TensorParallel


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


class ColumnParallelLinear(Linear):
    """Output features split across tensor-parallel ranks (worker_svc/parallel.py): each rank
    holds and computes its slice, no communication."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(input_size, tp.shard(output_size, "output features"), bias)
        self.tp = tp
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, _rank_slice(loaded_weight, 0, param.shape[0], self.tp))


class MergedLinear(ColumnParallelLinear):
    """Projections of one input stacked along the output dimension, in `shard_sizes` order, each
    split across tensor-parallel ranks.

    `shard_sizes` maps the checkpoint's shard id ("q", "k", "v" or 0, 1) to its output size.
    """

    def __init__(self, input_size: int, shard_sizes: dict[str | int, int], bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(input_size, sum(shard_sizes.values()), bias, tp)
        self.shard_offsets: dict[str | int, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            size = tp.shard(size, f"shard {shard_id!r} features")
            self.shard_offsets[shard_id] = (offset, size)
            offset += size

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: str | int) -> None:
        offset, size = self.shard_offsets[shard_id]
        default_weight_loader(param.data.narrow(0, offset, size),
                              _rank_slice(loaded_weight, 0, size, self.tp))


class QKVLinear(MergedLinear):
    """Split by heads across tensor-parallel ranks: `num_heads` and `num_kv_heads` are the
    model's totals."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TensorParallel = SINGLE) -> None:
        self.q_size = tp.shard(num_heads, "num_attention_heads") * head_size
        self.kv_size = tp.shard(num_kv_heads, "num_key_value_heads") * head_size
        super().__init__(hidden_size, {"q": num_heads * head_size, "k": num_kv_heads * head_size,
                                       "v": num_kv_heads * head_size}, bias, tp)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] → q [num_tokens, q_size], k, v [num_tokens, kv_size]."""
        return super().forward(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(Linear):
    """Input features split across tensor-parallel ranks (the output of a column-parallel
    layer): each rank multiplies its slice and one all-reduce sums the partial outputs; the bias
    is added once, after it."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(tp.shard(input_size, "input features"), output_size, bias)
        self.tp = tp
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, _rank_slice(loaded_weight, 1, param.shape[1], self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _rank_slice(loaded_weight: torch.Tensor, dim: int, size: int,
                tp: TensorParallel) -> torch.Tensor:
    """This rank's `size` rows (dim 0) or columns (dim 1) of a checkpoint tensor."""
    if loaded_weight.shape[dim] != size * tp.size:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(loaded_weight.shape)} has "
                         f"{loaded_weight.shape[dim]} along dim {dim}, the layer expects "
                         f"{size} × {tp.size} ranks")
    return loaded_weight.narrow(dim, tp.rank * size, size)


class VocabEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim),
                                   requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)
