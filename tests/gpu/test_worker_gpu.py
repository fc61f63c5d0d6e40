"""The worker on CUDA: HF parity in float32 with the GPU kernels, bfloat16 by default, the
memory profile, and swaps through pinned host memory. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from services.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from tests.integration.worker_driver import Driver, assert_matches_hf, make_worker
from tests.tiny_models import load_hf
from worker_svc.worker import Worker

pytestmark = pytest.mark.gpu

PROMPT = [5, 17, 33, 9, 100, 44, 3, 250, 61, 12, 8]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "opt"])
def test_float32_on_cuda_matches_hf(tiny_model_dir, arch):
    path = tiny_model_dir(arch)
    driver = Driver(make_worker(path, device="cuda", backend="auto", dtype="float32"))
    driver.add(0, PROMPT)
    driver.add(1, PROMPT[:4])
    driver.step({0: 6, 1: 4})
    driver.run_to_length([0, 1], len(PROMPT) + 16)
    hf = load_hf(path)
    for seq_id in (0, 1):
        assert_matches_hf(driver, hf, seq_id, atol=2e-3)


def test_cuda_defaults_profile_and_swap(tiny_model_dir):
    config = EngineConfig(model=ModelConfig(model=str(tiny_model_dir("llama"))),
                          cache=CacheConfig(gpu_memory_utilization=0.5, swap_space_gib=0.01),
                          device=DeviceConfig(device="auto"))
    worker = Worker(config)
    info = worker.load_model()
    assert info.device.startswith("cuda") and info.dtype == "bfloat16"
    profile = worker.profile_memory()
    assert profile.num_gpu_blocks > 0 and profile.num_cpu_blocks > 0
    worker.init_cache(min(profile.num_gpu_blocks, 64), min(profile.num_cpu_blocks, 8), 1)
    assert worker.cache_engine.cpu_cache[0].is_pinned()
    worker.warm_up()
    for layer in worker.cache_engine.gpu_cache:
        layer.copy_(torch.randn_like(layer))
    before = [layer.clone() for layer in worker.cache_engine.gpu_cache]
    worker.swap_blocks([(3, 0), (6, 1)], "out")
    worker.swap_blocks([(0, 10), (1, 11)], "in")
    torch.cuda.synchronize()
    for old, new in zip(before, worker.cache_engine.gpu_cache, strict=True):
        assert torch.equal(new[:, 10], old[:, 3]) and torch.equal(new[:, 11], old[:, 6])
