"""Paged attention against independent oracles: dense causal attention, and a prompt run in
chunks versus in one prefill. GPU-only cases cover long contexts (up to 8k) and the 256-token
blocks flash-attn pages natively."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from pagedserve.kernels import ref

from tests.kernels.batch import BATCH_KINDS, make_batch, make_metadata
from tests.kernels.conftest import ALL_BACKENDS, FAST_BACKENDS, TARGETS, TOLERANCES


def dense_causal_attention(query: torch.Tensor, keys: list[torch.Tensor],
                           values: list[torch.Tensor], query_lens: list[int],
                           scale: float) -> torch.Tensor:
    """Plain attention per sequence over contiguous K/V, queries at the sequence's end."""
    outs, start = [], 0
    for k, v, query_len in zip(keys, values, query_lens, strict=True):
        seq_len, num_kv_heads = k.shape[0], k.shape[1]
        q = query[start:start + query_len].float().transpose(0, 1)  # [heads, q_len, head]
        group = q.shape[0] // num_kv_heads
        k = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [heads, seq_len, head]
        v = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
        q_pos = torch.arange(seq_len - query_len, seq_len, device=q.device).unsqueeze(1)
        mask = torch.arange(seq_len, device=q.device).unsqueeze(0) <= q_pos  # [q_len, seq_len]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        outs.append(out.transpose(0, 1))
        start += query_len
    return torch.cat(outs).to(query.dtype)


@pytest.mark.parametrize("gqa", [1, 4])
@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_paged_attention_equals_dense_causal_attention(ops, device, dtype, gqa):
    prefills, decodes = BATCH_KINDS["mixed"]
    batch = make_batch(prefills, decodes, block_size=8, num_heads=2 * gqa, num_kv_heads=2,
                       head_size=64, dtype=dtype, device=device, seed=gqa)
    out = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, 0.125)
    expected = dense_causal_attention(batch.query, batch.dense_keys, batch.dense_values,
                                      batch.meta.query_lens_cpu, 0.125)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_prompt_in_three_chunks_equals_one_prefill(ops, device, dtype):
    """Chunked prefill: write and attend chunk by chunk (each chunk batched with a decode of
    another sequence), and the prompt's outputs match one full prefill."""
    gen = torch.Generator().manual_seed(1)
    block_size, num_kv_heads, num_heads, head_size = 8, 2, 4, 64
    prompt_len, chunks = 24, [(0, 8), (8, 9), (17, 7)]  # (context_len, query_len)
    prompt_table, other_table, num_blocks = [5, 0, 3], [2, 6], 8

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    query, key, value = (randn(prompt_len, h, head_size)
                         for h in (num_heads, num_kv_heads, num_kv_heads))
    other_key, other_value = randn(10, num_kv_heads, head_size), randn(10, num_kv_heads, head_size)

    def fresh_cache() -> torch.Tensor:
        return torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                          dtype=dtype, device=device)

    kv_cache = fresh_cache()
    meta = make_metadata([(0, prompt_len)], 1, [prompt_table], block_size, device)
    ops.write_kv(key, value, kv_cache[0], kv_cache[1], meta.slot_mapping)
    one_prefill = ops.paged_attention(query, kv_cache[0], kv_cache[1], meta, 0.125)

    kv_cache = fresh_cache()
    history = make_metadata([(0, 9)], 1, [other_table], block_size, device)
    ops.write_kv(other_key[:9], other_value[:9], kv_cache[0], kv_cache[1], history.slot_mapping)
    chunk_outs = []
    for context_len, query_len in chunks:
        rows = slice(context_len, context_len + query_len)
        # The other sequence decodes its 10th token at every step, at the same position.
        meta = make_metadata([(context_len, query_len), (9, 1)], 1, [prompt_table, other_table],
                             block_size, device)
        step_key = torch.cat([key[rows], other_key[9:]])
        step_value = torch.cat([value[rows], other_value[9:]])
        ops.write_kv(step_key, step_value, kv_cache[0], kv_cache[1], meta.slot_mapping)
        step_query = torch.cat([query[rows], randn(1, num_heads, head_size)])
        chunk_outs.append(
            ops.paged_attention(step_query, kv_cache[0], kv_cache[1], meta, 0.125)[:query_len])

    torch.testing.assert_close(torch.cat(chunk_outs), one_prefill, **TOLERANCES[dtype])


LONG_BATCH = (
    [(0, 700), (3000, 300), (0, 33)],  # a fresh prompt, a late chunk, a short prompt
    [(8191, 1), (4095, 1), (2047, 1), (15, 1)] + [(2000 + 37 * i, 1) for i in range(16)],
)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("target", TARGETS[1:])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_paged_attention_long_contexts(backend, ops, device, dtype, block_size):
    prefills, decodes = LONG_BATCH
    batch = make_batch(prefills, decodes, block_size=block_size, num_heads=32, num_kv_heads=8,
                       head_size=128, dtype=dtype, device=device, seed=block_size)
    scale = 128 ** -0.5
    out = ops.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    expected = ref.paged_attention(batch.query, batch.k_cache, batch.v_cache, batch.meta, scale)
    torch.testing.assert_close(out, expected, **TOLERANCES[dtype])
