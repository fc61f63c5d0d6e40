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
        self.draft_gpu_cache: list = []  # what a draft model's reads
        logger.info("simulated KV cache: %d device blocks, %d CPU blocks, %d bytes per block",
                    num_gpu_blocks, num_cpu_blocks, spec.bytes_per_block)

    def swap_out(self, pairs: list[tuple[int, int]], wait_for_compute: bool = True) -> float:
        """The copies' modelled seconds, on the copy engine (the real cache's side stream)."""
        return self._swap(pairs, self.num_gpu_blocks, self.num_cpu_blocks, wait_for_compute)

    def swap_in(self, pairs: list[tuple[int, int]], wait_for_compute: bool = True) -> float:
        return self._swap(pairs, self.num_cpu_blocks, self.num_gpu_blocks, wait_for_compute)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        check_block_pairs(pairs, self.num_gpu_blocks, self.num_gpu_blocks)
        if pairs:
            self.timeline.enqueue(self.roofline.block_moves_s(0, len(pairs),
                                                              self.spec.bytes_per_block))

    def _swap(self, pairs: list[tuple[int, int]], num_src: int, num_dst: int,
              wait_for_compute: bool) -> float:
        check_block_pairs(pairs, num_src, num_dst)
        if not pairs:
            return 0.0
        seconds = self.roofline.block_moves_s(len(pairs), 0, self.spec.bytes_per_block)
        self.timeline.enqueue_copy(seconds, wait_for_compute)
        return seconds

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """No data: a pulling simulated worker prices the bytes when it writes them."""
        check_block_pairs([(b, b) for b in block_ids], self.num_gpu_blocks, self.num_gpu_blocks)
        return b""

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        """The blocks cost what a swap-in of as many blocks would (one host link each way)."""
        check_block_pairs([(b, b) for b in block_ids], self.num_gpu_blocks, self.num_gpu_blocks)
        self.timeline.enqueue(self.roofline.block_moves_s(len(block_ids), 0,
                                                          self.spec.bytes_per_block))
