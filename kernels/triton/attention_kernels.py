"""Triton paged attention: a unified kernel for prefills and decodes, and a split-KV
(flash-decoding) pair for decodes over long contexts. A TILE_N tile may span several cache blocks,
so each key position looks up its own block. A GQA group's heads are extra rows of one program's
query tile (row = query_token * GROUP_P2 + head_in_group), so each K/V tile loads once per group.

No constexpr or specialized argument varies from step to step: Triton compiles a variant per
constexpr value and per integer argument's class (== 1, divisible by 16, other), so a step-varying
one would compile anew in the middle of serving. Step-varying integers are `do_not_specialize`d;
constexprs are fixed per model and launch table (docs/gpu-readiness.md)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc,  # [BLOCK_M, HEAD_P2], [BLOCK_M], [BLOCK_M], [BLOCK_M, HEAD_P2]
    q_pos,  # [BLOCK_M] sequence position of each row's query; a key is visible up to it
    k_cache_ptr, v_cache_ptr, block_table_ptr, tile_start, kv_end, kv_head, scale,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Online softmax over key positions tile_start .. tile_start + TILE_N below kv_end."""
    k_pos = tile_start + tl.arange(0, TILE_N)  # [TILE_N]
    is_key = k_pos < kv_end
    dim = tl.arange(0, HEAD_P2)
    is_dim = dim < HEAD_SIZE
    block = tl.load(block_table_ptr + k_pos // BLOCK_SIZE, mask=is_key, other=0).to(tl.int64)
    row = block * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_pos \
        + kv_head * stride_cache_head  # [TILE_N]
    # Keys past kv_end are not loaded at all: unwritten slots may hold NaN, and 0 * NaN is NaN.
    k = tl.load(k_cache_ptr + row[None, :] + dim[:, None],
                mask=is_key[None, :] & is_dim[:, None], other=0.0)  # [HEAD_P2, TILE_N]
    v = tl.load(v_cache_ptr + row[:, None] + dim[None, :],
                mask=is_key[:, None] & is_dim[None, :], other=0.0)  # [TILE_N, HEAD_P2]

    s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale  # [BLOCK_M, TILE_N]
    is_visible = (k_pos[None, :] <= q_pos[:, None]) & is_key[None, :]
    s = tl.where(is_visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))  # [BLOCK_M]
    # A row that has seen no key yet keeps m = -inf; shift by 0 so exp gives 0, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(s - m_shift[:, None])  # [BLOCK_M, TILE_N]
    alpha = tl.exp(m_i - m_shift)  # [BLOCK_M] rescales what was summed under the old max
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _find_seq(query_start_loc_ptr, q_block_index, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose query blocks hold q_block_index: sequence i's blocks start at
    query_start_loc[i] // BLOCK_Q + i, which bounds its ceil(query_len / BLOCK_Q) blocks."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_index:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs", "stride_block_table"])
def unified_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    query_ptr,  # [num_tokens, num_heads, head_size], last dim contiguous
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    scale, num_seqs,
    stride_query_token, stride_query_head,
    stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    stride_block_table,
    NUM_QUERIES_PER_KV: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (query block of the batch, KV head): a grid sized by the batch's tokens and
    sequences, not its longest query. A program past its sequence's queries returns at once."""
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_P2
    q_block_index = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block_index, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_block = q_block_index - (q_start // BLOCK_Q + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    q_idx = q_block * BLOCK_Q + rows // GROUP_P2  # [BLOCK_M] query token within the sequence
    head_in_group = rows % GROUP_P2
    head = kv_head * NUM_QUERIES_PER_KV + head_in_group  # [BLOCK_M]
    is_row = (q_idx < q_len) & (head_in_group < NUM_QUERIES_PER_KV)
    dim = tl.arange(0, HEAD_P2)
    is_dim = dim < HEAD_SIZE
    token = (q_start + q_idx).to(tl.int64)
    q = tl.load(query_ptr + token[:, None] * stride_query_token
                + head[:, None] * stride_query_head + dim[None, :],
                mask=is_row[:, None] & is_dim[None, :], other=0.0)  # [BLOCK_M, HEAD_P2]
    q_pos = context_len + q_idx  # [BLOCK_M]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    # Causality: no row of this query block sees past its last query's position.
    kv_end = tl.minimum(context_len + (q_block + 1) * BLOCK_Q, seq_len)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for tile_start in range(0, kv_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, tile_start,
            kv_end, kv_head, scale, stride_cache_block, stride_cache_pos, stride_cache_head,
            HEAD_SIZE, HEAD_P2, BLOCK_SIZE, TILE_N, DOT_PRECISION)

    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # padding rows have l = 0
    tl.store(out_ptr + token[:, None] * stride_out_token + head[:, None] * stride_out_head
             + dim[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=is_row[:, None] & is_dim[None, :])


@triton.jit(do_not_specialize=["first_seq", "first_token", "max_num_partitions",
                               "stride_block_table"])
def decode_partition_kernel(
    partial_out_ptr,  # [num_decodes, num_heads, max_num_partitions, HEAD_P2] fp32, normalized
    partial_max_ptr,  # [num_decodes, num_heads, max_num_partitions] fp32: softmax max m
    partial_sum_ptr,  # [num_decodes, num_heads, max_num_partitions] fp32: softmax sum l
    query_ptr,  # [num_tokens, num_heads, head_size]: decode d is token first_token + d
    k_cache_ptr, v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_size]
    block_tables_ptr,  # [num_seqs, max_num_blocks]: decode d is sequence first_seq + d
    seq_lens_ptr,  # [num_seqs]
    scale, first_seq, first_token, max_num_partitions,
    stride_query_token, stride_query_head,
    stride_cache_block, stride_cache_pos, stride_cache_head,
    stride_block_table,
    NUM_QUERIES_PER_KV: tl.constexpr, BLOCK_M: tl.constexpr,
    HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr, PARTITION_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Program (decode, KV head, partition)."""
    decode = tl.program_id(0)
    kv_head = tl.program_id(1)
    partition = tl.program_id(2)
    seq = first_seq + decode
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_start = partition * PARTITION_SIZE
    if kv_start >= seq_len:
        return
    kv_end = tl.minimum(kv_start + PARTITION_SIZE, seq_len)

    rows = tl.arange(0, BLOCK_M)  # one row per query head of the group, padded for tl.dot
    head = kv_head * NUM_QUERIES_PER_KV + rows
    is_row = rows < NUM_QUERIES_PER_KV
    dim = tl.arange(0, HEAD_P2)
    is_dim = dim < HEAD_SIZE
    token = (first_token + decode).to(tl.int64)
    q = tl.load(query_ptr + token * stride_query_token + head[:, None] * stride_query_head
                + dim[None, :], mask=is_row[:, None] & is_dim[None, :], other=0.0)
    q_pos = tl.full([BLOCK_M], seq_len - 1, tl.int32)  # the decode token is the last position

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P2], tl.float32)
    block_table_ptr = block_tables_ptr + seq.to(tl.int64) * stride_block_table
    for tile_start in range(kv_start, kv_end, TILE_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, q_pos, k_cache_ptr, v_cache_ptr, block_table_ptr, tile_start,
            kv_end, kv_head, scale, stride_cache_block, stride_cache_pos, stride_cache_head,
            HEAD_SIZE, HEAD_P2, BLOCK_SIZE, TILE_N, DOT_PRECISION)

    stat = (decode.to(tl.int64) * (tl.num_programs(1) * NUM_QUERIES_PER_KV) + head) \
        * max_num_partitions + partition  # [BLOCK_M]
    tl.store(partial_max_ptr + stat, m_i, mask=is_row)
    tl.store(partial_sum_ptr + stat, l_i, mask=is_row)
    tl.store(partial_out_ptr + stat[:, None] * HEAD_P2 + dim[None, :], acc / l_i[:, None],
             mask=is_row[:, None])


@triton.jit(do_not_specialize=["first_seq", "first_token", "max_num_partitions"])
def decode_reduce_kernel(
    out_ptr,  # [num_tokens, num_heads, head_size]
    partial_out_ptr, partial_max_ptr, partial_sum_ptr,  # as written by decode_partition_kernel
    seq_lens_ptr, first_seq, first_token, max_num_partitions,
    stride_out_token, stride_out_head,
    CHUNK: tl.constexpr, HEAD_SIZE: tl.constexpr, HEAD_P2: tl.constexpr,
    PARTITION_SIZE: tl.constexpr,
):
    """Program (decode, head): partition p weighs l_p * exp(m_p - max m), CHUNK partitions at a
    time with the running max rescaling what was summed before, so any context length runs the
    same compiled kernel."""
    decode = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + first_seq + decode)
    num_partitions = tl.cdiv(seq_len, PARTITION_SIZE)
    row = (decode.to(tl.int64) * tl.num_programs(1) + head) * max_num_partitions
    dim = tl.arange(0, HEAD_P2)
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_P2], tl.float32)
    for start in range(0, num_partitions, CHUNK):
        partition = start + tl.arange(0, CHUNK)
        is_partition = partition < num_partitions
        stat = row + partition
        part_max = tl.load(partial_max_ptr + stat, mask=is_partition, other=float("-inf"))
        part_sum = tl.load(partial_sum_ptr + stat, mask=is_partition, other=0.0)  # [CHUNK]
        partial = tl.load(partial_out_ptr + stat[:, None] * HEAD_P2 + dim[None, :],
                          mask=is_partition[:, None], other=0.0)  # [CHUNK, HEAD_P2]
        m_new = tl.maximum(m_i, tl.max(part_max, 0))
        alpha = tl.exp(m_i - m_new)  # the first chunk holds partition 0, so m_new is finite
        weight = part_sum * tl.exp(part_max - m_new)  # unused partitions: 0 * exp(-inf) = 0
        acc = acc * alpha + tl.sum(partial * weight[:, None], 0)
        l_i = l_i * alpha + tl.sum(weight, 0)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)  # [HEAD_P2]
    token = (first_token + decode).to(tl.int64)
    tl.store(out_ptr + token * stride_out_token + head * stride_out_head + dim,
             out.to(out_ptr.dtype.element_ty), mask=dim < HEAD_SIZE)
