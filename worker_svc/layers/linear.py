"""Linear layers that take their own checkpoint shards: q/k/v stack into one qkv_proj and gate/up
into one gate_up_proj, so a layer runs one matmul where the checkpoint has three or two."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu_linear
from pagedserve.services.common.cdiv import cdiv
from pagedserve.services.common.errors import ConfigError
from pagedserve.worker_svc.parallel import SINGLE, TensorParallel
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
        return cpu_linear.linear(x, self.weight, self.bias)


class ColumnParallelLinear(Linear):
    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(input_size, tp.shard(output_size, "output features"), bias)
        self.tp = tp
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, _rank_slice(loaded_weight, 0, param.shape[0], self.tp))


class MergedLinear(Linear):
    """`shard_sizes`: checkpoint shard id ("q", "k", "v" or 0, 1) → output size, in stacking order."""

    def __init__(self, input_size: int, shard_sizes: dict[str | int, int], bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        self._init_shards(input_size, {
            shard_id: (size, _even_part(size, tp, f"shard {shard_id!r} features"))
            for shard_id, size in shard_sizes.items()}, bias)

    def _init_shards(self, input_size: int, parts: dict[str | int, tuple[int, tuple[int, int]]],
                     bias: bool) -> None:
        """parts: shard id → (checkpoint size, (start, size) of the rows this rank keeps)."""
        super().__init__(input_size, sum(size for _, (_, size) in parts.values()), bias)
        # shard id → (offset in this layer's output, size, checkpoint size, start in it)
        self.shard_parts: dict[str | int, tuple[int, int, int, int]] = {}
        offset = 0
        for shard_id, (full_size, (start, size)) in parts.items():
            self.shard_parts[shard_id] = (offset, size, full_size, start)
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor,
                      shard_id: str | int) -> None:
        offset, size, full_size, start = self.shard_parts[shard_id]
        if loaded_weight.shape[0] != full_size:
            raise ValueError(f"weight shape mismatch: checkpoint shard {shard_id!r} has "
                             f"{loaded_weight.shape[0]} rows, the layer expects {full_size}")
        default_weight_loader(param.data.narrow(0, offset, size),
                              loaded_weight.narrow(0, start, size))


class QKVLinear(MergedLinear):
    """`num_heads` and `num_kv_heads` are the model's totals. With fewer KV heads than ranks, each
    is replicated on the ranks whose query heads read it."""

    def __init__(self, hidden_size: int, head_size: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TensorParallel = SINGLE) -> None:
        q = _even_part(num_heads * head_size, tp, "num_attention_heads", head_size)
        kv_head, num_rank_kv_heads = kv_heads_of_rank(num_kv_heads, tp)
        kv = (kv_head * head_size, num_rank_kv_heads * head_size)
        self.q_size, self.kv_size = q[1], kv[1]
        kv_full = num_kv_heads * head_size
        self._init_shards(hidden_size, {"q": (num_heads * head_size, q), "k": (kv_full, kv),
                                        "v": (kv_full, kv)}, bias)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [num_tokens, hidden] → q [num_tokens, q_size], k, v [num_tokens, kv_size]."""
        return super().forward(x).split_with_sizes([self.q_size, self.kv_size, self.kv_size], -1)


def kv_heads_of_rank(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, number of KV heads) this rank holds."""
    if num_kv_heads % tp.size == 0:
        per_rank = num_kv_heads // tp.size
        return tp.rank * per_rank, per_rank
    if tp.size % num_kv_heads == 0:
        return tp.rank * num_kv_heads // tp.size, 1
    raise ConfigError(f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={tp.size} "
                      "must divide one another")


def _even_part(size: int, tp: TensorParallel, what: str, unit: int = 1) -> tuple[int, int]:
    part = tp.shard(size // unit, what) * unit
    return tp.rank * part, part


class RowParallelLinear(Linear):
    """The bias is added once, after the all-reduce."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(tp.shard(input_size, "input features"), output_size, bias)
        self.tp = tp
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, _rank_slice(loaded_weight, 1, param.shape[1], self.tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(cpu_linear.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _rank_slice(loaded_weight: torch.Tensor, dim: int, size: int,
                tp: TensorParallel) -> torch.Tensor:
    if loaded_weight.shape[dim] != size * tp.size:
        raise ValueError(f"weight shape mismatch: checkpoint {tuple(loaded_weight.shape)} has "
                         f"{loaded_weight.shape[dim]} along dim {dim}, the layer expects "
                         f"{size} × {tp.size} ranks")
    return loaded_weight.narrow(dim, tp.rank * size, size)


class VocabEmbedding(nn.Module):
    """Split by vocabulary rows across ranks, each holding ceil(num_embeddings / ranks) rows
    (the last zero-padded); a rank embeds zeros outside its range before the all-reduce."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TensorParallel = SINGLE
                 ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp = tp
        rows = cdiv(num_embeddings, tp.size)
        self.vocab_start = tp.rank * rows
        self.vocab_end = min(self.vocab_start + rows, num_embeddings)
        self.weight = nn.Parameter(torch.empty(rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
        if loaded_weight.shape[0] != self.num_embeddings:
            raise ValueError(f"weight shape mismatch: checkpoint has {loaded_weight.shape[0]} "
                             f"rows, the layer expects {self.num_embeddings}")
        num_rows = self.vocab_end - self.vocab_start
        default_weight_loader(param.data[:num_rows],
                              loaded_weight[self.vocab_start:self.vocab_end])
        param.data[num_rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        mine = (ids >= self.vocab_start) & (ids < self.vocab_end)
        out = F.embedding((ids - self.vocab_start) * mine, self.weight)
        return self.tp.all_reduce(out * mine.unsqueeze(-1))

    def lm_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """[num_rows, dim] → float32 [num_rows, num_embeddings] on rank 0, None on the others."""
        logits = cpu_linear.linear(hidden_states, self.weight).float()
        if self.tp.size == 1:
            return logits
        logits = self.tp.gather(logits)
        return None if logits is None else logits[:, :self.num_embeddings]
