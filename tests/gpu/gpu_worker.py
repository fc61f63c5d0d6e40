"""Workers on CUDA for the GPU tests: every knob the tests vary, the rest small and fixed."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from pagedserve.kernels.backend import flash_attn_available
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
)
from pagedserve.worker_svc.worker import Worker

# Every backend that runs on CUDA; flash_attn only where the package is installed.
CUDA_BACKENDS = [
    pytest.param("torch"),
    pytest.param("triton"),
    pytest.param("flash_attn", marks=pytest.mark.skipif(not flash_attn_available(),
                                                        reason="flash_attn is not installed")),
]


def prompt(seed: int, length: int, vocab: int = 256) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def cuda_config(model_dir: Path, *, backend: str = "triton", dtype: str = "float32",
                max_num_seqs: int = 8, num_gpu_blocks: int = 128, num_cpu_blocks: int = 32,
                block_size: int = 8, **device: object) -> EngineConfig:
    """A CUDA worker's config; `device` holds DeviceConfig's other fields (enable_cuda_graph,
    max_cuda_graph_tokens...), their defaults where not given."""
    return EngineConfig(
        model=ModelConfig(model=str(model_dir), dtype=dtype),
        cache=CacheConfig(block_size=block_size, num_gpu_blocks_override=num_gpu_blocks,
                          num_cpu_blocks_override=num_cpu_blocks),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        device=DeviceConfig(device="cuda", attention_backend=backend, **device))


def cuda_worker(model_dir: Path, **options: object) -> Worker:
    """A worker through the whole handshake: load, profile, init_cache, warm_up (which captures
    the CUDA graphs when enable_cuda_graph is on). `options` are cuda_config's."""
    worker = Worker(cuda_config(model_dir, **options))
    worker.load_model()
    profile = worker.profile_memory()
    worker.init_cache(profile.num_gpu_blocks, profile.num_cpu_blocks, 1)
    worker.warm_up()
    return worker
