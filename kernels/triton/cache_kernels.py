"""Triton kernels that move K/V rows: write_kv (reshape-and-cache) and copy-on-write block copies."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    value_ptr,  # [num_tokens, num_kv_heads, head_size], last dim contiguous
    k_cache_ptr,  # [num_blocks * block_size, num_kv_heads, head_size] (flat view), contiguous
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64, -1 = skip
    stride_key_token, stride_key_head,
    stride_value_token, stride_value_head,
    stride_cache_slot, stride_cache_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr,
    HEADS_P2: tl.constexpr, HEAD_P2: tl.constexpr,
):
    """One program per token."""
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    head = tl.arange(0, HEADS_P2)[:, None]  # [HEADS_P2, 1]
    dim = tl.arange(0, HEAD_P2)[None, :]  # [1, HEAD_P2]
    mask = (head < NUM_KV_HEADS) & (dim < HEAD_SIZE)
    cache_offsets = slot * stride_cache_slot + head * stride_cache_head + dim
    k = tl.load(key_ptr + token * stride_key_token + head * stride_key_head + dim, mask=mask)
    tl.store(k_cache_ptr + cache_offsets, k, mask=mask)
    v = tl.load(value_ptr + token * stride_value_token + head * stride_value_head + dim, mask=mask)
    tl.store(v_cache_ptr + cache_offsets, v, mask=mask)


@triton.jit
def copy_blocks_kernel(
    cache_ptr,  # layer 0's kv_cache [2, num_blocks, block_size, num_kv_heads, head_size]
    layer_offsets_ptr,  # [num_layers] int64: element offset of each layer's kv_cache from layer 0's
    block_mapping_ptr,  # [num_pairs, 2] int64: (src block, dst block)
    stride_kv, stride_block,
    BLOCK_NUMEL: tl.constexpr,  # elements in one block of K (or V): block_size * kv_heads * head
    TILE: tl.constexpr,
):
    """Program (pair, layer, K or V); layers share shape, dtype and device, addressed from layer 0."""
    pair = tl.program_id(0)
    layer = tl.program_id(1)
    half = tl.program_id(2)  # 0 = K, 1 = V
    src = tl.load(block_mapping_ptr + 2 * pair)
    dst = tl.load(block_mapping_ptr + 2 * pair + 1)
    base = cache_ptr + tl.load(layer_offsets_ptr + layer) + half * stride_kv
    src_ptr = base + src * stride_block
    dst_ptr = base + dst * stride_block
    for start in range(0, BLOCK_NUMEL, TILE):
        offsets = start + tl.arange(0, TILE)  # [TILE]
        mask = offsets < BLOCK_NUMEL
        tl.store(dst_ptr + offsets, tl.load(src_ptr + offsets, mask=mask), mask=mask)
