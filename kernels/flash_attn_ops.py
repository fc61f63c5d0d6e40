"""flash-attn backend: FlashAttention-2's paged kernels where they apply, Triton elsewhere.
flash-attn 2.x pages only caches whose block size is a multiple of 256, in fp16/bf16, with head
sizes up to 256 in steps of 8; its causal mask is bottom-right, so chunks after cached context
attend correctly."""

from __future__ import annotations

import functools
import logging

import torch
from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache
from pagedserve.kernels import triton_ops
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.kernels.triton_ops import copy_blocks, swap_blocks, warm_up_batches, write_kv

# warm_up_batches: the Triton kernels run where flash-attn cannot
__all__ = ["write_kv", "paged_attention", "swap_blocks", "copy_blocks", "warm_up_batches"]

logger = logging.getLogger(__name__)

_DERIVED_KEY = "flash_attn"
PAGED_BLOCK_MULTIPLE = 256
MAX_HEAD_SIZE = 256


def unsupported_reason(query: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why flash-attn cannot run on this cache, or None when it can."""
    block_size, head_size = k_cache.shape[1], k_cache.shape[3]
    if block_size % PAGED_BLOCK_MULTIPLE:
        return f"block_size {block_size} is not a multiple of {PAGED_BLOCK_MULTIPLE}"
    if query.dtype not in (torch.float16, torch.bfloat16):
        return f"dtype {query.dtype} is not float16 or bfloat16"
    if head_size > MAX_HEAD_SIZE or head_size % 8:
        return f"head_size {head_size} is not a multiple of 8 up to {MAX_HEAD_SIZE}"
    if query.device.type != "cuda":
        return f"device {query.device} is not CUDA"
    return None


@functools.cache
def _log_fallback(reason: str) -> None:
    logger.info("flash_attn backend: %s, using the Triton attention kernels", reason)


def _cu_seqlens_k(meta: AttentionMetadata) -> torch.Tensor:
    """[num_prefills + 1] int32"""
    cu_seqlens_k = meta.derived.get(_DERIVED_KEY)
    if cu_seqlens_k is None:
        seq_lens = meta.seq_lens[:meta.num_prefills]
        cu_seqlens_k = torch.zeros(meta.num_prefills + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        meta.derived[_DERIVED_KEY] = cu_seqlens_k
    return cu_seqlens_k


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    reason = unsupported_reason(query, k_cache)
    if reason is not None:
        _log_fallback(reason)
        return triton_ops.paged_attention(query, k_cache, v_cache, meta, scale)
    num_prefills, num_prefill_tokens = meta.num_prefills, meta.num_prefill_tokens
    out = torch.empty_like(query)
    if num_prefills:
        out[:num_prefill_tokens] = flash_attn_varlen_func(
            query[:num_prefill_tokens], k_cache, v_cache,
            cu_seqlens_q=meta.query_start_loc[:num_prefills + 1],
            cu_seqlens_k=_cu_seqlens_k(meta),
            max_seqlen_q=max(meta.query_lens_cpu[:num_prefills]),
            max_seqlen_k=max(meta.seq_lens_cpu[:num_prefills]),
            softmax_scale=scale, causal=True,
            block_table=meta.block_tables[:num_prefills])
    if meta.num_decode_tokens:
        decode_query = query[num_prefill_tokens:].unsqueeze(1)  # [num_decodes, 1, heads, head]
        out[num_prefill_tokens:] = flash_attn_with_kvcache(
            decode_query, k_cache, v_cache,
            cache_seqlens=meta.seq_lens[num_prefills:],
            block_table=meta.block_tables[num_prefills:],
            softmax_scale=scale, causal=True).squeeze(1)
    return out
