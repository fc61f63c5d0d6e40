"""A decoder layer's ops outside the GEMMs and attention as torch.library custom ops, one
dispatcher node each: a dispatch trace (the simulator's, on the meta device) or a CUDA graph sees
one kernel where the torch layers launch several. CUDA runs the Triton kernels
(`kernels.triton_layer_ops`, imported at first use), CPU the references of `kernels.ref` (the
layers keep their own torch code on CPU; these serve tests), the fake implementations give the
shapes on the meta device."""

from __future__ import annotations

import torch
from pagedserve.kernels import ref


def _triton():  # noqa: ANN202
    from pagedserve.kernels import triton_layer_ops

    return triton_layer_ops


@torch.library.custom_op("pagedserve::rms_norm", mutates_args=(), device_types="cuda")
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _triton().rms_norm(x, weight, eps)


@torch.library.custom_op("pagedserve::fused_add_rms_norm", mutates_args=(), device_types="cuda")
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _triton().fused_add_rms_norm(x, residual, weight, eps)


@torch.library.custom_op("pagedserve::silu_and_mul", mutates_args=(), device_types="cuda")
def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    return _triton().silu_and_mul(x)


@torch.library.custom_op("pagedserve::rotary_write_kv", mutates_args=("k_cache", "v_cache"),
                         device_types="cuda")
def rotary_write_kv(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """With q_norm_weight and k_norm_weight: Qwen3's per-head q/k RMSNorm in the same launch."""
    return _triton().rotary_write_kv(positions, query, key, value, cos_sin_cache, k_cache,
                                     v_cache, slot_mapping, q_norm_weight, k_norm_weight, eps)


rms_norm.register_kernel("cpu", ref.rms_norm)
fused_add_rms_norm.register_kernel("cpu", ref.fused_add_rms_norm)
silu_and_mul.register_kernel("cpu", ref.silu_and_mul)
rotary_write_kv.register_kernel("cpu", ref.rotary_write_kv)


@rms_norm.register_fake
def _(x, weight, eps):  # noqa: ANN001, ANN202
    return torch.empty(x.shape, dtype=x.dtype, device=x.device)


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):  # noqa: ANN001, ANN202
    return (torch.empty(x.shape, dtype=x.dtype, device=x.device),
            torch.empty(x.shape, dtype=x.dtype, device=x.device))


@silu_and_mul.register_fake
def _(x):  # noqa: ANN001, ANN202
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@rotary_write_kv.register_fake
def _(positions, query, key, value, cos_sin_cache, k_cache, v_cache, slot_mapping,  # noqa: ANN001, ANN202
      q_norm_weight=None, k_norm_weight=None, eps=0.0):  # noqa: ANN001
    head_size = k_cache.shape[3]
    shape = query.shape if query.dim() == 3 else (query.shape[0], query.shape[1] // head_size,
                                                   head_size)
    return query.new_empty(shape)
