"""The sim's memory profile: the KV blocks the named GPU would hold, estimated from the shapes
since nothing is allocated."""

from __future__ import annotations

from pagedserve.services.common.config import CacheConfig, GiB, SchedulerConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.step_plan import MemoryProfile
from pagedserve.worker_svc.cache_engine import KVCacheSpec
from pagedserve.worker_svc.sim.roofline import Roofline

CUDA_CONTEXT_BYTES = GiB // 2  # context, cuBLAS workspace, allocator slack


def activations_peak_bytes(roofline: Roofline, scheduler_config: SchedulerConfig) -> int:
    """The largest step's biggest live tensors: the MLP's gate and up projections and a few
    hidden-sized buffers per token, plus float32 logits for every sequence."""
    m = roofline.model
    per_token = (2 * m.intermediate_size + 4 * m.hidden_size) * roofline.dtype_bytes
    return (scheduler_config.max_num_batched_tokens * per_token
            + scheduler_config.max_num_seqs * m.vocab_size * 4)


def sim_memory_profile(roofline: Roofline, spec: KVCacheSpec, cache_config: CacheConfig,
                       scheduler_config: SchedulerConfig,
                       draft: Roofline | None = None) -> MemoryProfile:
    """draft: a draft model's, whose weights share the device (its KV layers are in spec)."""
    weights = sum(r.model.num_params * r.dtype_bytes for r in (roofline, draft) if r is not None)
    activations = activations_peak_bytes(roofline, scheduler_config)
    budget = (roofline.gpu.memory_bytes * cache_config.gpu_memory_utilization
              - CUDA_CONTEXT_BYTES - weights - activations)
    num_gpu_blocks = cache_config.num_gpu_blocks_override or int(budget // spec.bytes_per_block)
    if num_gpu_blocks <= 0:
        raise ConfigError(
            f"{roofline.model.name} does not fit on a simulated {roofline.gpu.name}: weights "
            f"{weights / GiB:.1f} GiB, activations {activations / GiB:.1f} GiB of "
            f"{roofline.gpu.memory_bytes / GiB:.1f} GiB x gpu_memory_utilization="
            f"{cache_config.gpu_memory_utilization}")
    num_cpu_blocks = int(cache_config.swap_space_gib * GiB // spec.bytes_per_block)
    if cache_config.num_cpu_blocks_override >= 0:
        num_cpu_blocks = cache_config.num_cpu_blocks_override
    return MemoryProfile(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
                         weights_bytes=weights, activations_peak_bytes=activations,
                         kv_bytes_per_block=spec.bytes_per_block)
