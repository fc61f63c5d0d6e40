"""The simulated KV cache: the real one's block counts, no tensors. Cache ops are checked like
the real ones and cost the time their bytes would take; no data moves."""

from __future__ import annotations

import logging

from pagedserve.worker_svc.cache_engine import KVCacheSpec, check_block_pairs
from pagedserve.worker_svc.sim.roofline import Roofline
from pagedserve.worker_svc.sim.timeline import GpuTimeline

logger = logging.getLogger(__name__)


class SimCacheEngine:
    def __init__(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int,
                 roofline: Roofline, timeline: GpuTimeline) -> None:
        self.spec = spec
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.roofline = roofline
        self.timeline = timeline
        self.gpu_cache: list = []  # what the forward reads: nothing
        logger.info("simulated KV cache: %d device blocks, %d CPU blocks, %d bytes per block",
                    num_gpu_blocks, num_cpu_blocks, spec.bytes_per_block)

    def swap_out(self, pairs: list[tuple[int, int]]) -> float:
        """The copies' modelled seconds."""
        return self._move(pairs, self.num_gpu_blocks, self.num_cpu_blocks, is_swap=True)

    def swap_in(self, pairs: list[tuple[int, int]]) -> float:
        return self._move(pairs, self.num_cpu_blocks, self.num_gpu_blocks, is_swap=True)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        self._move(pairs, self.num_gpu_blocks, self.num_gpu_blocks, is_swap=False)

    def _move(self, pairs: list[tuple[int, int]], num_src: int, num_dst: int,
              is_swap: bool) -> float:
        check_block_pairs(pairs, num_src, num_dst)
        if not pairs:
            return 0.0
        n = len(pairs)
        seconds = self.roofline.block_moves_s(n if is_swap else 0, 0 if is_swap else n,
                                              self.spec.bytes_per_block)
        self.timeline.enqueue(seconds)
        return seconds

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """No data: a pulling simulated worker prices the bytes when it writes them."""
        check_block_pairs([(b, b) for b in block_ids], self.num_gpu_blocks, self.num_gpu_blocks)
        return b""

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        """The blocks cost what a swap-in of as many blocks would (one host link each way)."""
        self._move([(b, b) for b in block_ids], self.num_gpu_blocks, self.num_gpu_blocks,
                   is_swap=True)
