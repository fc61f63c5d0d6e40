"""How many KV blocks fit (vLLM's determine_num_available_blocks). On CUDA the cache gets what
gpu_memory_utilization leaves after weights, the largest step's activation peak, memory torch does
not own, and the CUDA graphs: they are captured after the cache is allocated, so their memory is
reserved here. On CPU the budget is kv_cache_memory_gib."""

from __future__ import annotations

import gc
import logging

import torch
from pagedserve.services.common.config import CacheConfig, GiB, SchedulerConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.step_plan import MemoryProfile
from pagedserve.worker_svc.cache_engine import KVCacheSpec, allocate_kv_caches
from pagedserve.worker_svc.cuda_graphs import graph_memory_bytes
from pagedserve.worker_svc.model_runner import ModelRunner, dummy_num_blocks
from torch import nn

logger = logging.getLogger(__name__)


def profile_query_lens(scheduler_config: SchedulerConfig, max_model_len: int) -> list[int]:
    num_tokens = scheduler_config.max_num_batched_tokens
    num_seqs = min(scheduler_config.max_num_seqs, num_tokens)
    lens = [num_tokens // num_seqs] * num_seqs
    lens[0] += num_tokens % num_seqs
    return [min(n, max_model_len) for n in lens]


def weights_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _profile_cuda(runner: ModelRunner, spec: KVCacheSpec, query_lens: list[int],
                  device: torch.device) -> int:
    """Bytes, the dummy run's own KV blocks excluded."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    baseline = torch.cuda.memory_allocated(device)
    num_blocks = dummy_num_blocks(query_lens, spec.block_size)
    kv_caches = allocate_kv_caches(spec, num_blocks, device)
    runner.dummy_run(query_lens, kv_caches)
    peak = torch.cuda.max_memory_allocated(device) - baseline - num_blocks * spec.bytes_per_block
    del kv_caches
    gc.collect()
    torch.cuda.empty_cache()
    return max(peak, 0)


def profile_memory(runner: ModelRunner, model: nn.Module, spec: KVCacheSpec,
                   cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                   max_model_len: int, device: torch.device,
                   graph_batch_sizes: list[int] | None = None,
                   graph_max_seq_len: int = 0) -> MemoryProfile:
    """graph_batch_sizes: the decode CUDA graphs WarmUp will capture."""
    bytes_per_block = spec.bytes_per_block
    model_bytes = weights_bytes(model)
    activations = graphs = 0
    if device.type == "cuda":
        activations = _profile_cuda(runner, spec, profile_query_lens(scheduler_config,
                                                                     max_model_len), device)
        if graph_batch_sizes:
            graphs = graph_memory_bytes(model, spec, graph_batch_sizes, graph_max_seq_len,
                                        device)
        free, total = torch.cuda.mem_get_info(device)
        not_torch = total - free - torch.cuda.memory_reserved(device)
        budget = (total * cache_config.gpu_memory_utilization - not_torch - model_bytes
                  - activations - graphs)
        num_gpu_blocks = int(budget // bytes_per_block)
        logger.info("memory profile: total %.2f GiB, weights %.2f GiB, activations %.2f GiB, "
                    "CUDA graphs %.2f GiB, other %.2f GiB", total / GiB, model_bytes / GiB,
                    activations / GiB, graphs / GiB, not_torch / GiB)
    else:
        num_gpu_blocks = int(cache_config.kv_cache_memory_gib * GiB // bytes_per_block)
    if cache_config.num_gpu_blocks_override > 0:
        num_gpu_blocks = cache_config.num_gpu_blocks_override
    if num_gpu_blocks <= 0:
        raise ConfigError(f"no memory left for the KV cache (weights {model_bytes} bytes, "
                          f"activations {activations} bytes, CUDA graphs {graphs} bytes); raise "
                          f"gpu_memory_utilization={cache_config.gpu_memory_utilization}, lower "
                          f"max_num_batched_tokens={scheduler_config.max_num_batched_tokens} or "
                          f"turn enable_cuda_graph off")
    num_cpu_blocks = int(cache_config.swap_space_gib * GiB // bytes_per_block)
    if cache_config.num_cpu_blocks_override >= 0:
        num_cpu_blocks = cache_config.num_cpu_blocks_override
    return MemoryProfile(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                         weights_bytes=model_bytes, activations_peak_bytes=activations,
                         kv_bytes_per_block=bytes_per_block)
