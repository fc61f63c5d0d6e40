"""Tensor parallelism across worker processes, one rank each (a GPU with NCCL; gloo on CPU).

Megatron-style: attention heads and MLP columns are split across the ranks, and each block's
output projection ends in one all-reduce (layers/linear.py: ColumnParallelLinear,
RowParallelLinear), so every rank holds the same hidden states after each block. Embeddings and
the LM head are split by vocabulary rows (VocabEmbedding): an all-reduce after the lookup, and
rank 0 gathers the logits. Each rank keeps the KV cache of its own heads. Only rank 0 samples;
it broadcasts the sampled token ids, so every rank's mirror appends the same tokens (the
scheduler reads rank 0's StepResult).

The ranks meet at `ParallelConfig.distributed_init_address` (rank 0 listens there) when they load
the model, so they start together. A group cannot take a restarted rank back, so a rank whose
collective fails (a peer died) exits the process with GROUP_BROKEN_EXIT_CODE: every rank then
restarts (Kubernetes, `pagedserve serve`), they meet again, and the scheduler rebuilds them as
after any worker restart.
"""

from __future__ import annotations

import datetime
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.step_plan import SampledSequence

logger = logging.getLogger(__name__)

GROUP_BROKEN_EXIT_CODE = 75  # EX_TEMPFAIL: restart me


@dataclass(frozen=True, slots=True)
class TensorParallel:
    rank: int = 0
    size: int = 1

    def shard(self, total: int, what: str) -> int:
        """This rank's share of `total` (heads, features): an even split or an error."""
        if total % self.size:
            raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size="
                              f"{self.size}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        if self.size > 1:
            self._collective(dist.all_reduce, x)
        return x

    def _collective(self, op: Callable[..., object], *args: object, **kwargs: object) -> None:
        try:
            op(*args, **kwargs)
        except RuntimeError as exc:  # a peer died or timed out: this group is over
            logger.critical("rank %d: a tensor-parallel collective failed (%s); exiting so "
                            "that every rank restarts and meets again", self.rank, exc)
            logging.shutdown()
            os._exit(GROUP_BROKEN_EXIT_CODE)

    def gather(self, x: torch.Tensor) -> torch.Tensor | None:
        """The ranks' `x` concatenated along the last dim, in rank order, on rank 0 (None on
        the others); every rank's `x` has the same shape."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._collective(dist.gather, x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_samples(self, sampled: list[SampledSequence], seq_ids: list[int],
                          device: torch.device) -> list[SampledSequence]:
        """Rank 0's sampled token ids for `seq_ids` (the sequences that sampled this step, in
        the same order on every rank), on every rank; the other ranks pass an empty `sampled`
        and get entries without logprobs."""
        if self.size == 1 or not seq_ids:
            return sampled
        counts = torch.zeros(len(seq_ids), dtype=torch.int64)
        if self.rank == 0:
            by_seq = {s.seq_id: s.token_ids for s in sampled}
            counts = torch.tensor([len(by_seq[i]) for i in seq_ids], dtype=torch.int64)
        counts = counts.to(device)
        self._collective(dist.broadcast, counts, src=0)
        num_tokens = counts.tolist()
        ids = torch.zeros(sum(num_tokens), dtype=torch.int64)
        if self.rank == 0:
            ids = torch.tensor([t for i in seq_ids for t in by_seq[i]], dtype=torch.int64)
        ids = ids.to(device)
        self._collective(dist.broadcast, ids, src=0)
        if self.rank == 0:
            return sampled
        token_ids = ids.tolist()
        out, start = [], 0
        for seq_id, n in zip(seq_ids, num_tokens, strict=True):
            out.append(SampledSequence(seq_id=seq_id, token_ids=token_ids[start:start + n],
                                       logprobs=[0.0] * n))
            start += n
        return out


SINGLE = TensorParallel()


def init_tensor_parallel(rank: int, size: int, init_address: str, device: torch.device,
                         timeout_s: float) -> TensorParallel:
    """Join the tensor-parallel group (blocks until every rank has joined, up to `timeout_s`,
    which also bounds every collective later); SINGLE without tensor parallelism."""
    if size == 1:
        return SINGLE
    if not 0 <= rank < size:
        raise ConfigError(f"rank must be in [0, tensor_parallel_size={size}), got {rank}")
    if dist.is_initialized():
        if (dist.get_rank(), dist.get_world_size()) != (rank, size):
            raise ConfigError(f"this worker already joined a tensor-parallel group as rank "
                              f"{dist.get_rank()} of {dist.get_world_size()}; restart it to "
                              f"serve as rank {rank} of {size}")
        return TensorParallel(rank, size)
    backend = "nccl" if device.type == "cuda" else "gloo"
    logger.info("rank %d of %d: joining the tensor-parallel group at %s (%s)", rank, size,
                init_address, backend)
    dist.init_process_group(backend, init_method=f"tcp://{init_address}", rank=rank,
                            world_size=size, timeout=datetime.timedelta(seconds=timeout_s))
    return TensorParallel(rank, size)


def leave_tensor_parallel() -> None:
    """Leave the group before the process exits (its threads would otherwise abort the exit)."""
    if dist.is_initialized():
        dist.destroy_process_group()
