"""Triton kernels for a decoder layer's work outside the GEMMs and attention: RMSNorm with its
residual add, SiLU-and-mul, and rotary embedding fused with the K/V cache write. Math in float32,
rounded to the input dtype where the torch layers round, so the two paths agree."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(
    out_ptr,  # [num_tokens, num_heads, hidden], contiguous
    residual_out_ptr,  # [num_tokens, num_heads, hidden] x + residual, contiguous (HAS_RESIDUAL)
    x_ptr,  # [num_tokens, num_heads, hidden], last dim contiguous
    residual_ptr,  # like x (HAS_RESIDUAL)
    weight_ptr,  # [hidden]
    eps,
    stride_x_token, stride_x_head,
    stride_residual_token, stride_residual_head,
    NUM_HEADS: tl.constexpr, HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    """One program per row (token, head); a plain [num_tokens, hidden] input has one head."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < HIDDEN
    x = tl.load(x_ptr + token * stride_x_token + head * stride_x_head + cols, mask=mask,
                other=0.0)
    row = (token * NUM_HEADS + head) * HIDDEN
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + token * stride_residual_token
                           + head * stride_residual_head + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(residual.dtype)
        tl.store(residual_out_ptr + row + cols, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x32 * x32, axis=0) / HIDDEN + eps)
    normed = (x32 * rstd).to(x.dtype).to(tl.float32)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row + cols, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def silu_and_mul_kernel(
    out_ptr,  # [num_tokens, intermediate], contiguous
    x_ptr,  # [num_tokens, 2 * intermediate] (gate then up), last dim contiguous
    stride_x_token,
    INTERMEDIATE: tl.constexpr, BLOCK: tl.constexpr,
):
    """Program (token, column tile)."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTERMEDIATE
    row = x_ptr + token * stride_x_token
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + INTERMEDIATE + cols, mask=mask, other=0.0)
    gate32 = gate.to(tl.float32)
    activated = (gate32 / (1.0 + tl.exp(-gate32))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + token * INTERMEDIATE + cols,
             (activated * up.to(tl.float32)).to(gate.dtype), mask=mask)


@triton.jit
def rotary_write_kv_kernel(
    query_out_ptr,  # [num_tokens, num_heads, head_size], contiguous
    query_ptr,  # [num_tokens, num_heads, head_size], last dim contiguous
    key_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    positions_ptr,  # [num_tokens] int64
    cos_sin_ptr,  # [max_position, head_size] float32: cos of each frequency, then sin
    k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_size] (flat view), contiguous
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = no cache write
    q_norm_ptr, k_norm_ptr, eps,  # HAS_QK_NORM: the [head_size] RMSNorm weights of q and k
    stride_query_token, stride_query_head,
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    stride_cache_slot, stride_cache_head,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HALF_P2: tl.constexpr, HAS_QK_NORM: tl.constexpr,
):
    """Program (token, head): heads below NUM_HEADS rotate a query head into query_out, the
    rest rotate a key head and copy its value head into the cache slot (neox layout: the
    first half of a head pairs with the second). HAS_QK_NORM: each query and key head is first
    RMS-normalized with its weight (Qwen3), rounded as kernels.ref.rms_norm rounds."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    half = HEAD_SIZE // 2
    dim = tl.arange(0, HALF_P2)
    mask = dim < half
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if (head >= NUM_HEADS) & (slot < 0):
        return
    position = tl.load(positions_ptr + token).to(tl.int64)
    cos = tl.load(cos_sin_ptr + position * HEAD_SIZE + dim, mask=mask, other=0.0)
    sin = tl.load(cos_sin_ptr + position * HEAD_SIZE + half + dim, mask=mask, other=0.0)
    if head < NUM_HEADS:
        src = query_ptr + token * stride_query_token + head * stride_query_head
        dst = query_out_ptr + (token * NUM_HEADS + head) * HEAD_SIZE
        norm_ptr = q_norm_ptr
    else:
        kv_head = head - NUM_HEADS
        src = key_ptr + token * stride_key_token + kv_head * stride_key_head
        dst = k_cache_ptr + slot * stride_cache_slot + kv_head * stride_cache_head
        norm_ptr = k_norm_ptr
        full = tl.arange(0, 2 * HALF_P2)
        v = tl.load(value_ptr + token * stride_value_token + kv_head * stride_value_head + full,
                    mask=full < HEAD_SIZE)
        tl.store(v_cache_ptr + slot * stride_cache_slot + kv_head * stride_cache_head + full, v,
                 mask=full < HEAD_SIZE)
    x1 = tl.load(src + dim, mask=mask, other=0.0)
    x2 = tl.load(src + half + dim, mask=mask, other=0.0)
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_QK_NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=0) + tl.sum(b * b, axis=0)) / HEAD_SIZE + eps)
        w1 = tl.load(norm_ptr + dim, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(norm_ptr + half + dim, mask=mask, other=0.0).to(tl.float32)
        a = ((a * rstd).to(x1.dtype).to(tl.float32) * w1).to(x1.dtype).to(tl.float32)
        b = ((b * rstd).to(x1.dtype).to(tl.float32) * w2).to(x1.dtype).to(tl.float32)
    cos, sin = cos.to(tl.float32), sin.to(tl.float32)
    tl.store(dst + dim, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(dst + half + dim, (b * cos + a * sin).to(x1.dtype), mask=mask)
