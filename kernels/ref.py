"""Readable references every fast backend matches in signature and is tested against. Shapes:
  key, value:   [num_tokens, num_kv_heads, head_size]
  query, out:   [num_tokens, num_heads, head_size]
  k/v_cache:    [num_blocks, block_size, num_kv_heads, head_size]   (one layer's K or V)
  kv_cache:     [2, num_blocks, block_size, num_kv_heads, head_size] (one layer, K then V)
The layer ops (rms_norm, fused_add_rms_norm, silu_and_mul, rotary_write_kv) round to the input
dtype where the torch layers of worker_svc/layers do.
"""

from __future__ import annotations

import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.cdiv import cdiv


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Slot -1 is skipped."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        k_cache[block, offset] = key[i]
        v_cache[block, offset] = value[i]


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[seq_len, num_kv_heads, head_size]"""
    block_size = cache.shape[1]
    num_blocks = cdiv(seq_len, block_size)
    blocks = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kv_heads, head]
    return blocks.flatten(0, 1)[:seq_len]


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The new tokens' K/V must already be in the cache; a query at position p sees 0..p."""
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        q = query[starts[i]:starts[i + 1]].float()  # [q_len, num_heads, head]
        q_len = q.shape[0]
        k = gather_kv(k_cache, meta.block_tables[i], seq_len).float()  # [seq_len, kv_heads, head]
        v = gather_kv(v_cache, meta.block_tables[i], seq_len).float()
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale  # [num_heads, q_len, seq_len]
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(seq_len, device=query.device).unsqueeze(0)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = scores.softmax(dim=-1)
        out[starts[i]:starts[i + 1]] = torch.einsum("hqk,khd->qhd", probs, v).to(query.dtype)
    return out


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """block_mapping: [n, 2] (src, dst)"""
    for s, d in block_mapping.tolist():
        dst[:, d].copy_(src[:, s])


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """block_mapping: [n, 2] (src, dst)"""
    for s, d in block_mapping.tolist():
        for kv_cache in kv_caches:
            kv_cache[:, d].copy_(kv_cache[:, s])


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] → [..., hidden]"""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed.float() * weight.float()).to(x.dtype)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual)"""
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, 2 * intermediate] (gate, up) → [num_tokens, intermediate]"""
    gate, up = x.chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate.float()).to(x.dtype).float() * up.float()).to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_size]; cos, sin: [num_tokens, 1, head_size / 2] float32.
    Neox layout: element i of a head pairs with element i + head_size / 2."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rotary_write_kv(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, cos_sin_cache: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    q_norm_weight: torch.Tensor | None = None,
                    k_norm_weight: torch.Tensor | None = None, eps: float = 0.0) -> torch.Tensor:
    """Rotates query and key by their positions (cos_sin_cache: [max_position, head_size], the
    cosines then the sines), writes the rotated key and the value to the cache and returns the
    rotated query [num_tokens, num_heads, head_size]. query, key, value: [num_tokens, heads *
    head_size] or [num_tokens, heads, head_size]. With q_norm_weight and k_norm_weight each
    head is RMS-normalized (rms_norm) before it is rotated."""
    num_tokens, head_size = positions.shape[0], k_cache.shape[3]
    cos, sin = cos_sin_cache[positions].float().unsqueeze(1).chunk(2, dim=-1)
    query = query.reshape(num_tokens, -1, head_size)
    key = key.reshape(num_tokens, -1, head_size)
    if q_norm_weight is not None:
        query, key = rms_norm(query, q_norm_weight, eps), rms_norm(key, k_norm_weight, eps)
    query, key = rotate(query, cos, sin), rotate(key, cos, sin)
    write_kv(key, value.reshape(num_tokens, -1, head_size), k_cache, v_cache, slot_mapping)
    return query
