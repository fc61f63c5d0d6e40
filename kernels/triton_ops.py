"""Triton backend: the wrappers check shapes and hold the launch policy, the kernels hold none.
On CPU, `TRITON_INTERPRET=1` must be set before import (Triton reads it at decoration). swap_blocks
is the torch backend's: no single kernel can address both GPU and host memory portably."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import triton
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.torch_ops import check_cache_pair, swap_blocks
from pagedserve.kernels.triton.attention_kernels import (
    decode_partition_kernel,
    decode_reduce_kernel,
    unified_attention_kernel,
)
from pagedserve.kernels.triton.cache_kernels import copy_blocks_kernel, write_kv_kernel
from pagedserve.kernels.triton_config import LAUNCH_CONFIGS, device_arch, launch_config

__all__ = ["write_kv", "paged_attention", "swap_blocks", "copy_blocks", "warm_up_batches"]

_DERIVED_KEY = "triton"
# Decodes whose context is longer than one partition use the split-KV path: a short batch of long
# sequences otherwise leaves most of the GPU idle, one program per (sequence, KV head).
DECODE_PARTITION_SIZE = 512
# ... unless the batch has this many (sequence, KV head) programs: then the unified kernel fills
# the device alone (about four programs an SM of an H100's 132), and the partitions add a
# reduction and, in a CUDA graph launched for its capture bound (8192 tokens: 16 partitions),
# programs past every real context that start only to return.
SPLIT_KV_MAX_PROGRAMS = 512
# Partitions the split-KV reduce combines per loop iteration: a fixed width, so the number of
# partitions (which grows with the step's longest context) never selects a compiled variant.
REDUCE_CHUNK = 16


@dataclass(slots=True)
class Launch:
    """One kernel launch, built apart from running it so that `kernels.triton_aot` compiles
    exactly what the ops launch."""

    kernel: Any  # a @triton.jit function
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any] = field(default_factory=dict)  # constexprs, num_warps, num_stages

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.kwargs)


@dataclass(slots=True)
class LaunchPlan:
    """Derived from host fields only, which CUDA-graph capture sets to upper bounds. So the
    kernels must be correct for any real lengths up to those: they read lengths on the device,
    and a program past its sequence's query or context returns without writing."""

    num_unified_seqs: int  # sequences the unified kernel covers (all, or only the prefills)
    num_unified_tokens: int
    max_unified_query_len: int
    num_split_decodes: int  # decodes handled by the split-KV kernels (0 = none)
    max_num_partitions: int


def _launch_plan(meta: AttentionMetadata, num_kv_heads: int) -> LaunchPlan:
    # cached for the step's every layer; a model of other KV heads on the same metadata would
    # reuse it, which picks a kernel by the other's count but computes the same attention
    plan = meta.derived.get(_DERIVED_KEY)
    if plan is None:
        decode_seq_lens = meta.seq_lens_cpu[meta.num_prefills:]
        is_split = (bool(decode_seq_lens) and max(decode_seq_lens) > DECODE_PARTITION_SIZE
                    and len(decode_seq_lens) * num_kv_heads < SPLIT_KV_MAX_PROGRAMS)
        num_unified = meta.num_prefills if is_split else meta.num_seqs
        plan = LaunchPlan(
            num_unified_seqs=num_unified,
            num_unified_tokens=(meta.num_prefill_tokens if is_split
                                else meta.slot_mapping.shape[0]),
            max_unified_query_len=max(meta.query_lens_cpu[:num_unified], default=0),
            num_split_decodes=len(decode_seq_lens) if is_split else 0,
            max_num_partitions=triton.cdiv(max(decode_seq_lens), DECODE_PARTITION_SIZE)
            if is_split else 0,
        )
        meta.derived[_DERIVED_KEY] = plan
    return plan


def _check_rows(name: str, x: torch.Tensor, num_heads: int, head_size: int) -> None:
    if x.dim() != 3 or x.shape[1:] != (num_heads, head_size) or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [num_tokens, {num_heads}, {head_size}] with a contiguous "
                         f"last dim, got shape {tuple(x.shape)} strides {x.stride()}")


def write_kv_launch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> Launch | None:
    check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    _check_rows("key", key, num_kv_heads, head_size)
    _check_rows("value", value, num_kv_heads, head_size)
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return None
    return Launch(write_kv_kernel, (num_tokens,), (
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(1), k_cache.stride(2),
    ), dict(NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
            HEADS_P2=triton.next_power_of_2(num_kv_heads),
            HEAD_P2=triton.next_power_of_2(head_size)))


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    launch = write_kv_launch(key, value, k_cache, v_cache, slot_mapping)
    if launch is not None:
        launch()


def _check_attention_inputs(query: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor) -> None:
    check_cache_pair(k_cache, v_cache)
    _, num_kv_heads, head_size = k_cache.shape[1:]
    num_heads = query.shape[1]
    _check_rows("query", query, num_heads, head_size)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.dtype != k_cache.dtype:
        raise ValueError(f"query dtype {query.dtype} differs from the cache's {k_cache.dtype}")


def attention_launches(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                       arch: int | None) -> list[Launch]:
    """The launches of one paged_attention call into `out`, tuned for compute capability major
    `arch` (None: the interpreter)."""
    _check_attention_inputs(query, k_cache, v_cache)
    block_size, num_kv_heads, head_size = k_cache.shape[1:]
    num_heads = query.shape[1]
    plan = _launch_plan(meta, num_kv_heads)
    config = launch_config(arch, head_size)
    group = num_heads // num_kv_heads
    head_p2 = max(16, triton.next_power_of_2(head_size))  # tl.dot needs K >= 16
    # fp32 would otherwise round through TF32 on NVIDIA GPUs; fp16/bf16 ignore the setting.
    precision = "ieee" if query.dtype == torch.float32 else "tf32"
    cache_strides = (k_cache.stride(0), k_cache.stride(1), k_cache.stride(2))
    common = dict(HEAD_SIZE=head_size, HEAD_P2=head_p2, BLOCK_SIZE=block_size,
                  DOT_PRECISION=precision)
    launches = []

    if plan.num_unified_seqs:
        group_p2 = triton.next_power_of_2(group)
        # Rows per program: many for long prompts, 16 (the tl.dot minimum) for short queries.
        is_prefill = plan.max_unified_query_len * group_p2 >= config.prefill_block_m
        block_m = config.prefill_block_m if is_prefill else 16
        tuning = config.prefill if is_prefill else config.decode
        tile_n = config.prefill_tile_n if is_prefill else config.decode_tile_n
        block_q = max(1, block_m // group_p2)
        # sequence i has at most query_len_i // block_q + 1 blocks
        grid = (plan.num_unified_tokens // block_q + plan.num_unified_seqs, num_kv_heads)
        launches.append(Launch(unified_attention_kernel, grid, (
            out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            scale, plan.num_unified_seqs, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
            *cache_strides, meta.block_tables.stride(0),
        ), dict(NUM_QUERIES_PER_KV=group, GROUP_P2=group_p2, BLOCK_Q=block_q, TILE_N=tile_n,
                **common, num_warps=tuning.num_warps, num_stages=tuning.num_stages)))

    if plan.num_split_decodes:
        num_decodes, max_parts = plan.num_split_decodes, plan.max_num_partitions
        # Two allocations, not one split in two: the second half's address would change its
        # 16-byte alignment, which Triton specializes on, with the step's shape.
        partial_max, partial_sum = (
            torch.empty(num_decodes, num_heads, max_parts, dtype=torch.float32,
                        device=query.device) for _ in range(2))
        partial_out = torch.empty(num_decodes, num_heads, max_parts, head_p2,
                                  dtype=torch.float32, device=query.device)
        first_seq, first_token = meta.num_prefills, meta.num_prefill_tokens
        launches.append(Launch(decode_partition_kernel, (num_decodes, num_kv_heads, max_parts), (
            partial_out, partial_max, partial_sum, query, k_cache, v_cache, meta.block_tables,
            meta.seq_lens, scale, first_seq, first_token, max_parts, query.stride(0),
            query.stride(1), *cache_strides, meta.block_tables.stride(0),
        ), dict(NUM_QUERIES_PER_KV=group, BLOCK_M=max(16, triton.next_power_of_2(group)),
                PARTITION_SIZE=DECODE_PARTITION_SIZE, TILE_N=config.decode_tile_n, **common,
                num_warps=config.decode.num_warps, num_stages=config.decode.num_stages)))
        launches.append(Launch(decode_reduce_kernel, (num_decodes, num_heads), (
            out, partial_out, partial_max, partial_sum, meta.seq_lens, first_seq, first_token,
            max_parts, out.stride(0), out.stride(1),
        ), dict(CHUNK=REDUCE_CHUNK, HEAD_SIZE=head_size, HEAD_P2=head_p2,
                PARTITION_SIZE=DECODE_PARTITION_SIZE,
                num_warps=config.reduce.num_warps, num_stages=config.reduce.num_stages)))
    return launches


def warm_up_batches(max_model_len: int) -> list[tuple[list[int], list[int]]]:
    """(query lens, context lens) of steps whose launches together are every compiled variant
    `attention_launches` has for a model: the unified kernel with decode tiles and with prefill
    tiles, and the split-KV pair. Every other launch argument that varies from step to step is
    unspecialized, so once a worker has run these no step compiles. Steps past max_model_len
    cannot happen, so are left out."""
    prefill_len = min(max(c.prefill_block_m for c in LAUNCH_CONFIGS.values()), max_model_len)
    batches = [([1], [0]), ([prefill_len], [0]), ([1], [DECODE_PARTITION_SIZE])]
    return [(q, c) for q, c in batches if q[0] + c[0] <= max_model_len]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    out = torch.empty_like(query)
    for launch in attention_launches(out, query, k_cache, v_cache, meta, scale,
                                     device_arch(query.device)):
        launch()
    return out


def copy_blocks_launch(kv_caches: list[torch.Tensor],
                       block_mapping: torch.Tensor) -> Launch | None:
    """One launch for all layers: programs (pair, layer, K or V)."""
    if block_mapping.numel() == 0 or not kv_caches:
        return None
    first = kv_caches[0]
    if not first.is_contiguous():
        raise ValueError("kv_cache of layer 0 must be contiguous")
    for layer, kv_cache in enumerate(kv_caches):
        if (kv_cache.shape != first.shape or kv_cache.dtype != first.dtype
                or kv_cache.device != first.device or not kv_cache.is_contiguous()):
            raise ValueError(f"kv_cache of layer {layer} differs from layer 0 in shape, dtype, "
                             f"device or contiguity")
    element_size = first.element_size()
    layer_offsets = torch.tensor(
        [(c.data_ptr() - first.data_ptr()) // element_size for c in kv_caches],
        dtype=torch.int64, device=first.device)
    mapping = block_mapping.to(first.device, torch.int64).contiguous()  # [num_pairs, 2]
    block_numel = first[0, 0].numel()
    return Launch(copy_blocks_kernel, (mapping.shape[0], len(kv_caches), 2), (
        first, layer_offsets, mapping, first.stride(0), first.stride(1),
    ), dict(BLOCK_NUMEL=block_numel, TILE=min(1024, triton.next_power_of_2(block_numel))))


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    launch = copy_blocks_launch(kv_caches, block_mapping)
    if launch is not None:
        launch()
