"""How many KV blocks fit (vLLM's determine_num_available_blocks). On CUDA the cache gets what
this instance's share of the device (gpu_memory_utilization) leaves after the weights, the
largest step's activation peak, the memory CUDA libraries took since the worker started, and the
CUDA graphs: they are captured after the cache is allocated, so their memory is reserved here.
kv_cache_memory_gib, when set, sizes the cache on any device; on CPU it is 1 GiB otherwise."""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch
from pagedserve.services.common.config import CacheConfig, GiB, SchedulerConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.step_plan import MemoryProfile
from pagedserve.worker_svc.cache_engine import KVCacheSpec, allocate_kv_caches
from pagedserve.worker_svc.cuda_graphs import DecodeGraphs
from pagedserve.worker_svc.graph_buckets import GraphBuckets
from pagedserve.worker_svc.mixed_graphs import MixedGraphs
from pagedserve.worker_svc.model_runner import ModelRunner, dummy_num_blocks
from torch import nn

logger = logging.getLogger(__name__)

CPU_KV_CACHE_GIB = 1.0  # the cache's size on CPU when kv_cache_memory_gib is 0
# Headroom reserved for CUDA graphs beyond the measured forwards, estimates rather than
# measurements: once for the capture stream's cuBLAS workspace and allocator rounding, and per
# graph for the instantiated graph and its kernel parameters.
GRAPH_BASE_HEADROOM_BYTES = 64 << 20
GRAPH_HEADROOM_BYTES = 2 << 20


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
    kv_bytes = sum(c.numel() * c.element_size() for c in kv_caches)  # the target's layers only
    peak = torch.cuda.max_memory_allocated(device) - baseline - kv_bytes
    del kv_caches
    gc.collect()
    torch.cuda.empty_cache()
    return max(peak, 0)


@torch.inference_mode()
def graph_memory_bytes(model: nn.Module, spec: KVCacheSpec, buckets: GraphBuckets,
                       device: torch.device) -> int:
    """Device bytes the graphs will hold: the larger eager forward peak of the largest decode
    and the largest mixed graph (all share one pool), every graph's output, and the headroom."""
    kv_caches = allocate_kv_caches(spec, 1, device)  # padding reads block 0 only
    largest: list[tuple[DecodeGraphs | MixedGraphs, int]] = []
    if buckets.batch_sizes:
        largest.append((DecodeGraphs(model, buckets.batch_sizes, buckets.max_seq_len,
                                     spec.block_size, device), max(buckets.batch_sizes)))
    if buckets.num_tokens:
        largest.append((MixedGraphs(model, buckets, spec.block_size, device),
                        max(buckets.num_tokens)))
    peak = row_bytes = 0
    for graphs, size in largest:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        baseline = torch.cuda.memory_allocated(device)
        hidden_states = graphs.run_static(size, kv_caches)  # [size, hidden]
        torch.cuda.synchronize(device)
        peak = max(peak, torch.cuda.max_memory_allocated(device) - baseline)
        row_bytes = hidden_states.shape[1] * hidden_states.element_size()
        del hidden_states
    del largest, graphs, kv_caches
    gc.collect()
    torch.cuda.empty_cache()
    num_rows = sum(buckets.batch_sizes) + sum(buckets.num_tokens)
    num_graphs = len(buckets.batch_sizes) + len(buckets.num_tokens)
    return (peak + num_rows * row_bytes + GRAPH_BASE_HEADROOM_BYTES
            + num_graphs * GRAPH_HEADROOM_BYTES)


@dataclass(frozen=True, slots=True)
class DeviceMemory:
    """What the CUDA profile measured, in bytes."""
    total: int  # the device's
    free: int  # on the whole device, after the profile (other processes' use included)
    weights: int
    activations: int  # the largest step's peak, above the weights
    graphs: int  # the CUDA graphs warm_up will capture
    non_torch: int  # this process's growth outside torch's allocator (CUDA libraries)


def num_gpu_blocks_for(memory: DeviceMemory, cache_config: CacheConfig,
                       bytes_per_block: int) -> int:
    """vLLM's meaning of gpu_memory_utilization: this instance's own share of the device, what
    other processes use aside, so that two instances at 0.45 each fit in either start order. The
    KV cache gets that share less the weights, the activation peak, the CUDA graphs and the
    memory CUDA libraries took; kv_cache_memory_gib, when set, is the cache's size instead. What
    is still to be allocated must be free now."""
    share = memory.total * cache_config.gpu_memory_utilization
    if cache_config.kv_cache_memory_gib > 0:
        kv_bytes = cache_config.kv_cache_memory_gib * GiB
        sizing = f"kv_cache_memory_gib={cache_config.kv_cache_memory_gib}"
    else:
        kv_bytes = (share - memory.weights - memory.activations - memory.graphs
                    - memory.non_torch)
        sizing = f"gpu_memory_utilization={cache_config.gpu_memory_utilization}"
    num_blocks = int(kv_bytes // bytes_per_block)
    if num_blocks <= 0:
        raise ConfigError(
            f"no memory left for the KV cache: {sizing} gives this instance "
            f"{share / GiB:.2f} GiB of the device's {memory.total / GiB:.2f} GiB, and the "
            f"weights take {memory.weights / GiB:.2f} GiB, activations "
            f"{memory.activations / GiB:.2f} GiB, CUDA graphs {memory.graphs / GiB:.2f} GiB, "
            f"CUDA libraries {memory.non_torch / GiB:.2f} GiB; raise gpu_memory_utilization, "
            "lower max_num_batched_tokens or max_cuda_graph_tokens, or turn "
            "enable_cuda_graph off")
    still_needed = num_blocks * bytes_per_block + memory.activations + memory.graphs
    if still_needed > memory.free:
        raise ConfigError(
            f"{sizing} needs {still_needed / GiB:.2f} GiB more for the KV cache, activations and "
            f"CUDA graphs, but only {memory.free / GiB:.2f} GiB of the device's "
            f"{memory.total / GiB:.2f} GiB are free (other processes use the rest); lower it")
    return num_blocks


def non_torch_bytes(device: torch.device) -> int:
    """The device's memory in use outside this process's torch allocator."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def profile_memory(runner: ModelRunner, model: nn.Module, spec: KVCacheSpec,
                   cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                   max_model_len: int, device: torch.device,
                   graph_buckets: GraphBuckets | None = None,
                   non_torch_baseline: int = 0) -> MemoryProfile:
    """graph_buckets: the CUDA graphs WarmUp will capture; non_torch_baseline: non_torch_bytes
    before the model was loaded."""
    bytes_per_block = spec.bytes_per_block
    model_bytes = weights_bytes(model)
    activations = graphs = 0
    memory = None
    if device.type == "cuda":
        activations = _profile_cuda(runner, spec, profile_query_lens(scheduler_config,
                                                                     max_model_len), device)
        if graph_buckets is not None:
            graphs = graph_memory_bytes(model, spec, graph_buckets, device)
            if runner.drafter is not None:  # its graphs, in a pool of their own
                graphs += graph_memory_bytes(runner.drafter.model, spec.draft_spec(),
                                             graph_buckets, device)
        free, total = torch.cuda.mem_get_info(device)
        memory = DeviceMemory(total=total, free=free, weights=model_bytes,
                              activations=activations, graphs=graphs,
                              non_torch=max(non_torch_bytes(device) - non_torch_baseline, 0))
        logger.info("memory profile: total %.2f GiB, free %.2f GiB, weights %.2f GiB, "
                    "activations %.2f GiB, CUDA graphs %.2f GiB, CUDA libraries %.2f GiB",
                    total / GiB, free / GiB, model_bytes / GiB, activations / GiB,
                    graphs / GiB, memory.non_torch / GiB)
    if cache_config.num_gpu_blocks_override > 0:
        num_gpu_blocks = cache_config.num_gpu_blocks_override
    elif memory is not None:
        num_gpu_blocks = num_gpu_blocks_for(memory, cache_config, bytes_per_block)
    else:
        num_gpu_blocks = int((cache_config.kv_cache_memory_gib or CPU_KV_CACHE_GIB) * GiB
                             // bytes_per_block)
    num_cpu_blocks = int(cache_config.swap_space_gib * GiB // bytes_per_block)
    if cache_config.num_cpu_blocks_override >= 0:
        num_cpu_blocks = cache_config.num_cpu_blocks_override
    return MemoryProfile(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                         weights_bytes=model_bytes, activations_peak_bytes=activations,
                         kv_bytes_per_block=bytes_per_block)
