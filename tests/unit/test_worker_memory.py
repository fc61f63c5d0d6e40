"""KV-cache sizing: block bytes, CPU budgets, overrides, the profile batch shape."""

from __future__ import annotations

import re

import pytest
import torch
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    GiB,
    ModelConfig,
    SchedulerConfig,
)
from pagedserve.services.common.errors import ConfigError
from pagedserve.worker_svc.cache_engine import allocate_kv_caches
from pagedserve.worker_svc.memory import (
    CPU_KV_CACHE_GIB,
    DeviceMemory,
    num_gpu_blocks_for,
    profile_query_lens,
    weights_bytes,
)
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


H100 = 80 * GiB
BLOCK_BYTES = 2 << 20  # 2 MiB


def _cuda_memory(free: float, **gib: float) -> DeviceMemory:
    """A profile as measured on an 80 GiB device, in GiB."""
    sizes = dict(weights=3.0, activations=1.0, graphs=0.5, non_torch=0.5) | gib
    return DeviceMemory(total=H100, free=int(free * GiB),
                        **{k: int(v * GiB) for k, v in sizes.items()})


def test_gpu_memory_utilization_is_this_instances_share_in_either_start_order():
    """Two instances at 0.45: the one started second sees the first's 36 GiB in use and gets
    as many blocks (it used to count them against its own share, and found none left)."""
    share = CacheConfig(gpu_memory_utilization=0.45)
    first = num_gpu_blocks_for(_cuda_memory(free=76.0), share, BLOCK_BYTES)
    second = num_gpu_blocks_for(_cuda_memory(free=76.0 - 36.5), share, BLOCK_BYTES)
    # 36 GiB less weights, activations, graphs and CUDA libraries: 31 GiB of 2 MiB blocks
    assert first == second == 31 * 512


def test_kv_cache_memory_gib_sizes_the_cache_on_cuda_too():
    config = CacheConfig(gpu_memory_utilization=0.9, kv_cache_memory_gib=4.0)
    assert num_gpu_blocks_for(_cuda_memory(free=76.0), config, BLOCK_BYTES) == 4 * 512


@pytest.mark.parametrize(("config", "free", "message"), [
    (CacheConfig(gpu_memory_utilization=0.45), 20.0,
     "gpu_memory_utilization=0.45 needs 32.50 GiB more for the KV cache, activations and CUDA "
     "graphs, but only 20.00 GiB of the device's 80.00 GiB are free"),
    (CacheConfig(kv_cache_memory_gib=30.0), 20.0,
     "kv_cache_memory_gib=30.0 needs 31.50 GiB more"),
    (CacheConfig(gpu_memory_utilization=0.05), 76.0,
     "no memory left for the KV cache: gpu_memory_utilization=0.05 gives this instance 4.00 GiB"),
])
def test_a_share_that_does_not_fit_is_refused_with_the_numbers(config, free, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        num_gpu_blocks_for(_cuda_memory(free=free), config, BLOCK_BYTES)


def test_cpu_cache_is_1_gib_unless_kv_cache_memory_gib_says(tiny_model_dir):
    profile = _worker(tiny_model_dir("llama")).profile_memory()
    assert profile.num_gpu_blocks == int(CPU_KV_CACHE_GIB * GiB) // profile.kv_bytes_per_block


def test_cuda_profile_subtracts_only_the_kv_bytes_it_allocated(monkeypatch):
    """The dummy run allocates the target's layers only: with a draft model, subtracting
    bytes_per_block (which counts the draft's layers) hid activation memory from the profile."""
    from pagedserve.worker_svc import memory
    from pagedserve.worker_svc.cache_engine import KVCacheSpec

    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_size=8, block_size=4,
                       dtype=torch.float32, num_draft_layers=3, draft_num_kv_heads=2,
                       draft_head_size=8)
    activations = 1 << 20
    allocated = []

    def allocate(spec, num_blocks, device):
        caches = allocate_kv_caches(spec, num_blocks, torch.device("cpu"))
        allocated.append(sum(c.numel() * c.element_size() for c in caches))
        return caches

    class Runner:
        def dummy_run(self, query_lens, kv_caches):
            pass

    for name in ("empty_cache", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated",
                        lambda device: allocated[-1] + activations)
    monkeypatch.setattr(memory, "allocate_kv_caches", allocate)
    assert memory._profile_cuda(Runner(), spec, [16], torch.device("cuda")) == activations
