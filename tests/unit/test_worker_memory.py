"""KV-cache sizing: block bytes, CPU budgets, overrides, the profile batch shape."""

from __future__ import annotations

import torch
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    GiB,
    ModelConfig,
    SchedulerConfig,
)
from pagedserve.worker_svc.cache_engine import allocate_kv_caches
from pagedserve.worker_svc.memory import profile_query_lens, weights_bytes
from pagedserve.worker_svc.model_runner import dummy_num_blocks
from pagedserve.worker_svc.worker import Worker


def _worker(path, **cache_kw) -> Worker:
    worker = Worker(EngineConfig(
        model=ModelConfig(model=str(path)), cache=CacheConfig(block_size=16, **cache_kw),
        scheduler=SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8),
        device=DeviceConfig(device="cpu", attention_backend="ref")))
    worker.load_model()
    return worker


def test_cpu_budget_sets_block_counts(tiny_model_dir):
    worker = _worker(tiny_model_dir("llama"), kv_cache_memory_gib=0.01, swap_space_gib=0.005)
    profile = worker.profile_memory()
    # 2 (K, V) × 2 layers × 16 slots × 2 kv heads × 16 head size × 4 bytes
    assert profile.kv_bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    assert profile.num_gpu_blocks == int(0.01 * GiB) // profile.kv_bytes_per_block
    assert profile.num_cpu_blocks == int(0.005 * GiB) // profile.kv_bytes_per_block
    assert profile.weights_bytes == weights_bytes(worker.runner.model) > 0
    worker.init_cache(profile.num_gpu_blocks, profile.num_cpu_blocks, scheduler_epoch=0)
    assert worker.cache_engine.gpu_cache[0].shape == (2, profile.num_gpu_blocks, 16, 2, 16)


def test_overrides_win(tiny_model_dir):
    worker = _worker(tiny_model_dir("opt"), num_gpu_blocks_override=7, num_cpu_blocks_override=0)
    profile = worker.profile_memory()
    assert (profile.num_gpu_blocks, profile.num_cpu_blocks) == (7, 0)


def test_profile_batch_splits_the_token_budget():
    lens = profile_query_lens(SchedulerConfig(max_num_batched_tokens=100, max_num_seqs=8), 512)
    assert lens == [16] + [12] * 7 and sum(lens) == 100
    assert profile_query_lens(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=1),
                              512) == [512]


def test_profile_forward_runs_at_the_largest_step(tiny_model_dir):
    """The dummy forward the CUDA profile measures, run here on CPU at the same shapes."""
    worker = _worker(tiny_model_dir("qwen2"))
    lens = profile_query_lens(worker.config.scheduler, worker.get_info().max_model_len)
    kv_caches = allocate_kv_caches(worker.kv_spec, dummy_num_blocks(lens, 16),
                                   torch.device("cpu"))
    worker.runner.dummy_run(lens, kv_caches)
    assert all(layer.abs().sum() > 0 for layer in kv_caches)  # every layer wrote its K/V
    worker.warm_up()
