"""Triton launches for the layer ops of `kernels.layer_ops`: the wrappers check shapes and pick
the launch, the kernels (kernels/triton/layer_kernels.py) hold no policy. Same signatures as the
references in `kernels.ref`."""

from __future__ import annotations

import torch
import triton
from pagedserve.kernels.torch_ops import check_cache_pair
from pagedserve.kernels.triton.layer_kernels import (
    rms_norm_kernel,
    rotary_write_kv_kernel,
    silu_and_mul_kernel,
)
from pagedserve.kernels.triton_ops import Launch

SILU_BLOCK = 1024
MAX_NORM_WARPS = 16


def _rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """x as [num_tokens, num_heads, size] without a copy (a 2-D input has one head)."""
    if x.dim() == 2:
        x = x.unsqueeze(1)
    if x.dim() != 3 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [num_tokens, size] or [num_tokens, heads, size] with a "
                         f"contiguous last dim, got shape {tuple(x.shape)} strides {x.stride()}")
    return x


def rms_norm_launch(out: torch.Tensor, residual_out: torch.Tensor | None, x: torch.Tensor,
                    residual: torch.Tensor | None, weight: torch.Tensor,
                    eps: float) -> Launch | None:
    rows = _rows("x", x)
    num_tokens, num_heads, hidden = rows.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight must be [{hidden}], got {tuple(weight.shape)}")
    if num_tokens == 0:
        return None
    block = triton.next_power_of_2(hidden)
    has_residual = residual is not None
    res_rows = _rows("residual", residual) if has_residual else rows
    if res_rows.shape != rows.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} differs from x's "
                         f"{tuple(x.shape)}")
    return Launch(rms_norm_kernel, (num_tokens, num_heads), (
        out, residual_out if has_residual else out, rows, res_rows, weight, eps,
        rows.stride(0), rows.stride(1), res_rows.stride(0), res_rows.stride(1),
    ), dict(NUM_HEADS=num_heads, HIDDEN=hidden, BLOCK=block, HAS_RESIDUAL=has_residual,
            num_warps=min(MAX_NORM_WARPS, max(1, block // 512))))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    launch = rms_norm_launch(out, None, x, None, weight, eps)
    if launch is not None:
        launch()
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    launch = rms_norm_launch(out, residual_out, x, residual, weight, eps)
    if launch is not None:
        launch()
    return out, residual_out


def silu_and_mul_launch(out: torch.Tensor, x: torch.Tensor) -> Launch | None:
    if x.dim() != 2 or x.shape[1] % 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [num_tokens, 2 * intermediate] with a contiguous last dim, "
                         f"got shape {tuple(x.shape)} strides {x.stride()}")
    num_tokens, intermediate = x.shape[0], x.shape[1] // 2
    if num_tokens == 0:
        return None
    block = min(SILU_BLOCK, triton.next_power_of_2(intermediate))
    return Launch(silu_and_mul_kernel, (num_tokens, triton.cdiv(intermediate, block)), (
        out, x, x.stride(0)), dict(INTERMEDIATE=intermediate, BLOCK=block, num_warps=4))


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty(x.shape[0], x.shape[1] // 2, dtype=x.dtype, device=x.device)
    launch = silu_and_mul_launch(out, x)
    if launch is not None:
        launch()
    return out


def _heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """[num_tokens, heads * head_size] → [num_tokens, heads, head_size] (a view)."""
    return x.unflatten(-1, (-1, head_size)) if x.dim() == 2 else x


def rotary_write_kv_launch(query_out: torch.Tensor, positions: torch.Tensor,
                           query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                           q_norm_weight: torch.Tensor | None = None,
                           k_norm_weight: torch.Tensor | None = None,
                           eps: float = 0.0) -> Launch | None:
    """q_norm_weight and k_norm_weight, both or neither: each head RMS-normalized first."""
    check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    num_tokens = positions.shape[0]
    query, key, value = (_rows(name, _heads(t, head_size))
                         for name, t in (("query", query), ("key", key), ("value", value)))
    for name, t in (("key", key), ("value", value)):
        if t.shape[1] != num_kv_heads:
            raise ValueError(f"{name} has {t.shape[1]} heads, the cache {num_kv_heads}")
    if cos_sin_cache.shape[1] != head_size or head_size % 2:
        raise ValueError(f"cos_sin_cache must be [max_position, {head_size}] for an even head "
                         f"size, got {tuple(cos_sin_cache.shape)}")
    has_qk_norm = q_norm_weight is not None
    if has_qk_norm != (k_norm_weight is not None):
        raise ValueError("q_norm_weight and k_norm_weight go together")
    for name, weight in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
        if weight is not None and weight.shape != (head_size,):
            raise ValueError(f"{name} must be [{head_size}], got {tuple(weight.shape)}")
    if num_tokens == 0:
        return None
    num_heads = query.shape[1]
    return Launch(rotary_write_kv_kernel, (num_tokens, num_heads + num_kv_heads), (
        query_out, query, key, value, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q_norm_weight if has_qk_norm else cos_sin_cache,
        k_norm_weight if has_qk_norm else cos_sin_cache, eps,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.stride(1), k_cache.stride(2),
    ), dict(NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size,
            HALF_P2=triton.next_power_of_2(head_size // 2), HAS_QK_NORM=has_qk_norm,
            num_warps=1))


def rotary_write_kv(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    query_heads = _heads(query, k_cache.shape[3])
    query_out = torch.empty(query_heads.shape, dtype=query.dtype, device=query.device)
    launch = rotary_write_kv_launch(query_out, positions, query, key, value, cos_sin_cache,
                                    k_cache, v_cache, slot_mapping, q_norm_weight,
                                    k_norm_weight, eps)
    if launch is not None:
        launch()
    return query_out
