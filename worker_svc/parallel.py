"""Megatron-style tensor parallelism, one worker process per rank (NCCL on GPU, gloo on CPU).
Only rank 0 samples and broadcasts the token ids, so every rank's mirror appends the same tokens.
A group cannot take a restarted rank back, so a failed collective exits with
GROUP_BROKEN_EXIT_CODE: every rank restarts and they meet again."""

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
        if total % self.size:
            raise ConfigError(f"{what}={total} is not divisible by tensor_parallel_size="
                              f"{self.size}")
        return total // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """In place."""
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
        """Concatenated along the last dim on rank 0; None on the others."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        self._collective(dist.gather, x.contiguous(), parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_samples(self, sampled: list[SampledSequence], seq_ids: list[int],
                          device: torch.device) -> list[SampledSequence]:
        """`seq_ids` must be in the same order on every rank; the others get no logprobs."""
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
    """Blocks until every rank has joined; `timeout_s` also bounds every later collective."""
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
    """Before the process exits: the group's threads would otherwise abort the exit."""
    if dist.is_initialized():
        dist.destroy_process_group()
