"""The worker's KV cache: per-layer device tensors, a CPU swap cache, and block moves.

On CUDA, swaps run asynchronously on a side stream, in the order they were issued, and compute
queued after a swap waits for it. A swap starts after the compute queued before it too, unless
its caller knows that compute touches none of its device blocks (`wait_for_compute=False`): then
it overlaps the step still running. Host code that inspects the swap cache must synchronize
first."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from types import ModuleType

import torch
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.worker_svc.host_to_device import to_device

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_size: int
    block_size: int
    dtype: torch.dtype
    # a draft model's layers (speculative decoding): in the same blocks, each of its own KV shape
    num_draft_layers: int = 0
    draft_num_kv_heads: int = 0
    draft_head_size: int = 0

    def __post_init__(self) -> None:
        if self.num_draft_layers and not (self.draft_num_kv_heads and self.draft_head_size):
            raise ValueError("a KV cache spec with draft layers needs their KV shape")

    @property
    def num_cache_layers(self) -> int:
        """The target's layers and the draft's: every one holds a tensor in the cache."""
        return self.num_layers + self.num_draft_layers

    def layer_shapes(self, with_draft: bool = True) -> list[tuple[int, int]]:
        """(num_kv_heads, head_size) of each cache layer: the target's, then the draft's."""
        draft = [(self.draft_num_kv_heads, self.draft_head_size)] * self.num_draft_layers
        return [(self.num_kv_heads, self.head_size)] * self.num_layers + (
            draft if with_draft else [])

    def draft_spec(self) -> KVCacheSpec:
        """The draft model's layers alone, as a model's own cache."""
        return KVCacheSpec(self.num_draft_layers, self.draft_num_kv_heads, self.draft_head_size,
                           self.block_size, self.dtype)

    @property
    def bytes_per_block(self) -> int:
        """Across all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.block_size * elem * sum(h * d for h, d in self.layer_shapes())


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device,
                       pin_memory: bool = False, zeroed: bool = True,
                       with_draft: bool = False) -> list[torch.Tensor]:
    """Per layer (the target model's, then the draft's if with_draft):
    [2, num_blocks, block_size, num_kv_heads, head_size]"""
    alloc = torch.zeros if zeroed else torch.empty
    return [alloc((2, num_blocks, spec.block_size, num_kv_heads, head_size), dtype=spec.dtype,
                  device=device, pin_memory=pin_memory)
            for num_kv_heads, head_size in spec.layer_shapes(with_draft)]


def check_block_pairs(pairs: list[tuple[int, int]], num_src: int, num_dst: int) -> None:
    for src, dst in pairs:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            raise InvalidRequest(f"block pair ({src}, {dst}) out of range: "
                                 f"src must be < {num_src}, dst < {num_dst}")


def check_cache_ops(blocks_to_swap_out: list[tuple[int, int]],
                    blocks_to_swap_in: list[tuple[int, int]],
                    blocks_to_copy: list[tuple[int, int]],
                    num_gpu_blocks: int, num_cpu_blocks: int) -> None:
    """Refuse a step's cache ops with a block id outside its pool, before any runs."""
    check_block_pairs(blocks_to_swap_out, num_gpu_blocks, num_cpu_blocks)
    check_block_pairs(blocks_to_swap_in, num_cpu_blocks, num_gpu_blocks)
    check_block_pairs(blocks_to_copy, num_gpu_blocks, num_gpu_blocks)


class CacheEngine:
    def __init__(self, spec: KVCacheSpec, num_gpu_blocks: int, num_cpu_blocks: int,
                 device: torch.device, backend: ModuleType) -> None:
        self.spec = spec
        self.num_gpu_blocks = num_gpu_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.device = device
        self.backend = backend
        # every layer's blocks move together: a draft model's KV follows its sequence's
        self._gpu_layers = allocate_kv_caches(spec, num_gpu_blocks, device, with_draft=True)
        self.gpu_cache = self._gpu_layers[:spec.num_layers]  # the target model's
        self.draft_gpu_cache = self._gpu_layers[spec.num_layers:]
        # Unzeroed: a swap block is only read after a swap-out wrote it, so start-up need not
        # touch gigabytes of host memory.
        self.cpu_cache = allocate_kv_caches(spec, num_cpu_blocks, torch.device("cpu"),
                                            pin_memory=device.type == "cuda", zeroed=False,
                                            with_draft=True)
        self.swap_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        logger.info("KV cache: %d device blocks, %d CPU blocks, %d bytes per block",
                    num_gpu_blocks, num_cpu_blocks, spec.bytes_per_block)

    def _mapping(self, pairs: list[tuple[int, int]], num_src: int, num_dst: int,
                 device: torch.device) -> torch.Tensor:
        check_block_pairs(pairs, num_src, num_dst)
        return to_device(pairs, torch.int64, device).view(-1, 2)  # [n, 2]

    def swap_out(self, pairs: list[tuple[int, int]], wait_for_compute: bool = True
                 ) -> float | None:
        """(device block, CPU block) pairs. Returns None: the caller's clock times the copies
        (a simulated cache returns their modelled seconds instead)."""
        if not pairs:
            return None
        if self.swap_stream is not None:
            check_block_pairs(pairs, self.num_gpu_blocks, self.num_cpu_blocks)
            self._swap_async(self._gpu_layers, self.cpu_cache, pairs, wait_for_compute)
            return None
        mapping = self._mapping(pairs, self.num_gpu_blocks, self.num_cpu_blocks,
                                torch.device("cpu"))
        for gpu_layer, cpu_layer in zip(self._gpu_layers, self.cpu_cache, strict=True):
            self.backend.swap_blocks(gpu_layer, cpu_layer, mapping)
        return None

    def swap_in(self, pairs: list[tuple[int, int]], wait_for_compute: bool = True
                ) -> float | None:
        """(CPU block, device block) pairs; returns as swap_out."""
        if not pairs:
            return None
        if self.swap_stream is not None:
            check_block_pairs(pairs, self.num_cpu_blocks, self.num_gpu_blocks)
            self._swap_async(self.cpu_cache, self._gpu_layers, pairs, wait_for_compute)
            return None
        mapping = self._mapping(pairs, self.num_cpu_blocks, self.num_gpu_blocks,
                                torch.device("cpu"))
        for gpu_layer, cpu_layer in zip(self._gpu_layers, self.cpu_cache, strict=True):
            self.backend.swap_blocks(cpu_layer, gpu_layer, mapping)
        return None

    def _swap_async(self, src_cache: list[torch.Tensor], dst_cache: list[torch.Tensor],
                    pairs: list[tuple[int, int]], wait_for_compute: bool) -> None:
        """One copy per contiguous [block_size, num_kv_heads, head_size] slab keeps every transfer
        a direct async copy between pinned host and device memory."""
        compute_stream = torch.cuda.current_stream(self.device)
        if wait_for_compute:
            self.swap_stream.wait_stream(compute_stream)
        with torch.cuda.stream(self.swap_stream):
            for src_layer, dst_layer in zip(src_cache, dst_cache, strict=True):
                for src, dst in pairs:
                    dst_layer[0, dst].copy_(src_layer[0, src], non_blocking=True)
                    dst_layer[1, dst].copy_(src_layer[1, src], non_blocking=True)
        compute_stream.wait_stream(self.swap_stream)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write (device block, device block) pairs."""
        if not pairs:
            return
        mapping = self._mapping(pairs, self.num_gpu_blocks, self.num_gpu_blocks, self.device)
        for layers in (self.gpu_cache, self.draft_gpu_cache):  # one KV shape per call
            self.backend.copy_blocks(layers, mapping)

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """Device blocks as bytes, block after block: per layer (a draft model's after the
        target's), K then V, each [block_size, num_kv_heads, head_size] (what `write_blocks`
        takes)."""
        check_block_pairs([(b, b) for b in block_ids], self.num_gpu_blocks, self.num_gpu_blocks)
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        # each layer's [2, n, block_size, num_kv_heads, head_size] -> [n, its bytes]
        blocks = torch.cat([layer.index_select(1, index).transpose(0, 1).reshape(len(block_ids), -1)
                            for layer in self._gpu_layers], dim=1).cpu()
        return blocks.view(torch.uint8).numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes) -> None:
        num_bytes = len(block_ids) * self.spec.bytes_per_block
        if len(data) != num_bytes:
            raise InvalidRequest(f"{len(block_ids)} KV blocks need {num_bytes} bytes, got "
                                 f"{len(data)}")
        check_block_pairs([(b, b) for b in block_ids], self.num_gpu_blocks, self.num_gpu_blocks)
        blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(self.spec.dtype).view(
            len(block_ids), -1).to(self.device)  # [n, elements of a block across layers]
        index = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
        start = 0
        for layer in self._gpu_layers:
            end = start + layer[:, 0].numel()
            layer.index_copy_(1, index, blocks[:, start:end].reshape(
                len(block_ids), 2, *layer.shape[2:]).transpose(0, 1))
            start = end
