"""Launch parameters of the Triton attention kernels, chosen per GPU architecture and head size.

The values come from compiling ahead of time (`tests/kernels/test_aot_compile.py` holds them to
their budgets): decode programs stay at or under 128 registers per thread so that at least four
4-warp programs share an SM, and enough stages that the compiler double-buffers the K/V tiles
in shared memory. The key space is (compute capability major, head size bucket)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KernelLaunch:
    num_warps: int
    num_stages: int  # software-pipelining depth of the key loop; 1 = no prefetch


@dataclass(frozen=True, slots=True)
class AttentionLaunchConfig:
    decode: KernelLaunch  # unified programs of 16 rows, and the split-KV partition kernel
    decode_tile_n: int  # key positions per inner-loop step; tl.dot needs at least 16
    prefill: KernelLaunch  # unified programs of prefill_block_m rows
    prefill_tile_n: int
    prefill_block_m: int  # query rows (tokens x GQA heads) per program for long queries
    reduce: KernelLaunch = KernelLaunch(num_warps=4, num_stages=1)  # the split-KV reduce


# Decode: 5 stages is the depth at which the K/V loads, which wait on the block-table gather a
# stage earlier, get two shared-memory buffers. Prefill: 8 warps keep the 64-row head-128 tiles
# under 128 registers per thread (4 warps spill on sm_80 once tiles grow).
LAUNCH_CONFIGS: dict[tuple[int, int], AttentionLaunchConfig] = {
    (8, 64): AttentionLaunchConfig(decode=KernelLaunch(4, 5), decode_tile_n=64,
                                   prefill=KernelLaunch(4, 3), prefill_tile_n=32,
                                   prefill_block_m=64),
    (8, 128): AttentionLaunchConfig(decode=KernelLaunch(4, 5), decode_tile_n=32,
                                    prefill=KernelLaunch(8, 3), prefill_tile_n=32,
                                    prefill_block_m=64),
    (9, 64): AttentionLaunchConfig(decode=KernelLaunch(4, 5), decode_tile_n=64,
                                   prefill=KernelLaunch(4, 3), prefill_tile_n=32,
                                   prefill_block_m=64),
    (9, 128): AttentionLaunchConfig(decode=KernelLaunch(4, 5), decode_tile_n=32,
                                    prefill=KernelLaunch(8, 3), prefill_tile_n=32,
                                    prefill_block_m=64),
}
INTERPRETER_ARCH = 8  # CPU runs under TRITON_INTERPRET=1 take tile sizes from this row


def launch_config(arch: int | None, head_size: int) -> AttentionLaunchConfig:
    """Newest architecture row at or below `arch` (None: the interpreter), then the smallest head
    size bucket that holds head_size (the largest for bigger heads)."""
    archs = sorted({a for a, _ in LAUNCH_CONFIGS})
    major = INTERPRETER_ARCH if arch is None else arch
    row = max((a for a in archs if a <= major), default=archs[0])
    buckets = sorted(h for a, h in LAUNCH_CONFIGS if a == row)
    bucket = next((h for h in buckets if h >= head_size), buckets[-1])
    return LAUNCH_CONFIGS[row, bucket]


@functools.cache
def _cuda_arch(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def device_arch(device: torch.device) -> int | None:
    """Compute capability major of a CUDA device; None for CPU tensors (the interpreter)."""
    if device.type != "cuda":
        return None
    return _cuda_arch(device.index if device.index is not None else torch.cuda.current_device())
