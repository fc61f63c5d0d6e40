"""Vectorized torch backend: the default on CPU and the baseline for the GPU kernels. Prefills
run as one batched SDPA call over K/V gathered whole blocks at a time; a mask is built only where
lengths differ, once per step (`meta.derived`). Decodes on CPU go to the compiled kernel that
reads the blocks in place (`cpu_decode`), elsewhere (or without a compiler) through SDPA the same
way as prefills. There a sequence with a few query tokens (a decode verifying drafts) goes to the
kernel too, one row per query token seeing the keys up to its own position, instead of having
its whole K/V gathered for SDPA in every layer."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu_decode, cpu_linear
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.cdiv import cdiv

_DERIVED_KEY = "torch"
# the longest query the CPU decode kernel takes row by row (a decode and 16 drafts)
_MAX_KERNEL_QUERY_LEN = 17


@dataclass(slots=True)
class KVGather:
    """Reused by every layer of the step: a fresh 10+ MB tensor per layer costs page faults on CPU."""

    block_ids: torch.Tensor  # [num_seqs * num_blocks] int64: block table entries, row-major
    num_seqs: int
    max_seq_len: int
    # Gathered rows past their sequence's length, zeroed after each gather: stale NaN there
    # would leak through the masked softmax as 0 * NaN. None when all lengths are equal.
    pad_rows: torch.Tensor | None
    k_out: torch.Tensor  # [num_seqs * num_blocks, block_size * num_kv_heads * head_size]
    v_out: torch.Tensor

    def gather(self, k_cache: torch.Tensor,
               v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_seqs, num_kv_heads, max_seq_len, head_size] views SDPA reads in place."""
        num_blocks, block_size, num_kv_heads, head_size = k_cache.shape
        k = torch.index_select(k_cache.view(num_blocks, -1), 0, self.block_ids, out=self.k_out)
        v = torch.index_select(v_cache.view(num_blocks, -1), 0, self.block_ids, out=self.v_out)
        if self.pad_rows is not None:
            k.view(-1, num_kv_heads * head_size).index_fill_(0, self.pad_rows, 0)
            v.view(-1, num_kv_heads * head_size).index_fill_(0, self.pad_rows, 0)
        shape = (self.num_seqs, -1, num_kv_heads, head_size)  # [num_seqs, padded_len, kv_heads, head]
        return (k.view(shape)[:, :self.max_seq_len].transpose(1, 2),
                v.view(shape)[:, :self.max_seq_len].transpose(1, 2))


@dataclass(slots=True)
class PrefillPlan:
    kv: KVGather
    max_query_len: int
    attn_mask: torch.Tensor | None  # [num_prefills, 1, max_query_len, max_seq_len]; None = causal
    token_rows: torch.Tensor | None  # [num_prefill_tokens] row in the padded query grid, None = unpadded
    padded_query: torch.Tensor | None  # [num_prefills * max_query_len, num_heads, head_size]


@dataclass(slots=True)
class DecodePlan:
    kv: KVGather | None  # None: `kernel` reads the blocks in place
    attn_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_seq_len]; None when lengths are equal
    block_tables: torch.Tensor  # [num_decodes, max_num_blocks] int32
    seq_lens: torch.Tensor  # [num_decodes] int32
    kernel: ModuleType | None = None  # the compiled CPU decode kernel


@dataclass(slots=True)
class AttentionPlan:
    prefill: PrefillPlan | None
    decode: DecodePlan | None
    # the query rows each part computes: the prefill tokens then the rest, unless short
    # prefills joined the decodes (then index tensors where long prefills stay apart)
    prefill_rows: slice | torch.Tensor
    decode_rows: slice | torch.Tensor


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must be [num_blocks, block_size, num_kv_heads, head_size] "
                         f"and equal, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous")


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
             v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_size)  # [num_blocks * block_size, kv_heads, head]
    v_flat = v_cache.view(-1, num_kv_heads, head_size)
    if bool((slot_mapping < 0).any()):  # padding tokens: only then pay for boolean indexing
        is_written = slot_mapping >= 0  # [num_tokens]
        slot_mapping, key, value = slot_mapping[is_written], key[is_written], value[is_written]
    slots = slot_mapping.long()
    k_flat.index_copy_(0, slots, key.to(k_cache.dtype))
    v_flat.index_copy_(0, slots, value.to(v_cache.dtype))


def _kv_gather(block_tables: torch.Tensor, seq_lens_cpu: list[int],
               k_cache: torch.Tensor) -> KVGather:
    block_size = k_cache.shape[1]
    num_seqs, max_seq_len = len(seq_lens_cpu), max(seq_lens_cpu)
    num_blocks = cdiv(max_seq_len, block_size)
    block_ids = block_tables[:, :num_blocks].flatten().long()  # [num_seqs * num_blocks]
    pad_rows = None
    if any(s != max_seq_len for s in seq_lens_cpu):
        # From the host lengths: no device readback.
        pos = torch.arange(max_seq_len)
        is_pad = pos >= torch.tensor(seq_lens_cpu).unsqueeze(1)  # [num_seqs, max_seq_len]
        seq_starts = torch.arange(num_seqs).unsqueeze(1) * (num_blocks * block_size)
        pad_rows = (seq_starts + pos)[is_pad].to(k_cache.device)
    block_numel = k_cache[0].numel()  # block_size * num_kv_heads * head_size
    return KVGather(block_ids, num_seqs, max_seq_len, pad_rows,
                    k_cache.new_empty(block_ids.numel(), block_numel),
                    k_cache.new_empty(block_ids.numel(), block_numel))


def _additive_mask(is_attended: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SDPA converts a bool mask on every call; the plan converts once per step."""
    mask = torch.zeros(is_attended.shape, dtype=dtype, device=is_attended.device)
    return mask.masked_fill_(~is_attended, float("-inf"))


def _prefill_plan(meta: AttentionMetadata, query: torch.Tensor,
                  k_cache: torch.Tensor) -> PrefillPlan:
    num_prefills = meta.num_prefills
    query_lens = meta.query_lens_cpu[:num_prefills]
    seq_lens_cpu = meta.seq_lens_cpu[:num_prefills]
    max_query_len, max_seq_len = max(query_lens), max(seq_lens_cpu)
    seq_lens = meta.seq_lens[:num_prefills]  # [num_prefills] on the device
    kv = _kv_gather(meta.block_tables[:num_prefills], seq_lens_cpu, k_cache)
    is_uniform = all(q == max_query_len for q in query_lens)
    if is_uniform and all(s == max_query_len for s in seq_lens_cpu):
        # Fresh prompts of one length: plain causal attention.
        return PrefillPlan(kv, max_query_len, None, None, None)

    starts = meta.query_start_loc[:num_prefills + 1].long()
    query_lens_t = starts[1:] - starts[:-1]  # [num_prefills]
    context_lens = seq_lens - query_lens_t
    q_idx = torch.arange(max_query_len, device=starts.device)
    # Bottom-right causal; padding rows clamp to the last position so they see valid keys.
    q_pos = torch.minimum(context_lens.unsqueeze(1) + q_idx, seq_lens.unsqueeze(1) - 1)
    k_pos = torch.arange(max_seq_len, device=starts.device)
    attn_mask = _additive_mask((k_pos.view(1, 1, -1) <= q_pos.unsqueeze(2)).unsqueeze(1),
                               query.dtype)  # [P, 1, max_q, max_s]
    if is_uniform:
        return PrefillPlan(kv, max_query_len, attn_mask, None, None)

    num_tokens = meta.num_prefill_tokens
    seq_idx = torch.repeat_interleave(torch.arange(num_prefills, device=starts.device),
                                      query_lens_t, output_size=num_tokens)  # [num_tokens]
    token_idx = torch.arange(num_tokens, device=starts.device)
    token_rows = seq_idx * max_query_len + token_idx - starts[seq_idx]
    # Zeros once: padding rows must hold finite values; later layers leave stale finite ones.
    padded_query = query.new_zeros(num_prefills * max_query_len, *query.shape[1:])
    return PrefillPlan(kv, max_query_len, attn_mask, token_rows, padded_query)


def prepare(device: torch.device) -> None:
    if device.type == "cpu":
        cpu_decode.load()  # compiles once per machine; later loads reuse the build
        cpu_linear.load()


def _decode_plan(meta: AttentionMetadata, k_cache: torch.Tensor) -> DecodePlan:
    first = meta.num_prefills
    seq_lens_cpu = meta.seq_lens_cpu[first:]
    seq_lens = meta.seq_lens[first:].to(torch.int32)  # [num_decodes]
    block_tables = meta.block_tables[first:].to(torch.int32)
    kernel = cpu_decode.load() if k_cache.device.type == "cpu" else None
    if kernel is not None:
        return DecodePlan(None, None, block_tables, seq_lens, kernel)
    kv = _kv_gather(block_tables, seq_lens_cpu, k_cache)
    if kv.pad_rows is None:  # one length: every gathered key is attended
        return DecodePlan(kv, None, block_tables, seq_lens)
    max_seq_len = kv.max_seq_len
    k_pos = torch.arange(max_seq_len, device=seq_lens.device)
    attn_mask = _additive_mask((k_pos < seq_lens.unsqueeze(1)).view(len(seq_lens), 1, 1, -1),
                               k_cache.dtype)
    return DecodePlan(kv, attn_mask, block_tables, seq_lens)


def _select(meta: AttentionMetadata, seq_ids: list[int]) -> AttentionMetadata:
    """The metadata of the prefills `seq_ids` alone."""
    query_lens = [meta.query_lens_cpu[i] for i in seq_ids]
    seq_lens_cpu = [meta.seq_lens_cpu[i] for i in seq_ids]
    index = torch.tensor(seq_ids, device=meta.seq_lens.device)
    query_start_loc = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32,
                                   device=meta.seq_lens.device)
    return AttentionMetadata(
        slot_mapping=meta.slot_mapping[:0], block_tables=meta.block_tables[index],
        seq_lens=meta.seq_lens[index], query_start_loc=query_start_loc,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens_cpu), num_prefills=len(seq_ids),
        num_prefill_tokens=sum(query_lens), query_lens_cpu=query_lens, seq_lens_cpu=seq_lens_cpu)


def _kernel_rows_plan(meta: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor,
                      kernel: ModuleType) -> AttentionPlan:
    """Every sequence of at most _MAX_KERNEL_QUERY_LEN query tokens to the decode kernel, query
    row j of a sequence as a decode at its position (its K/V is written before attention)."""
    query_lens, seq_lens = meta.query_lens_cpu, meta.seq_lens_cpu
    long_ids = [i for i in range(meta.num_seqs) if query_lens[i] > _MAX_KERNEL_QUERY_LEN]
    short_ids = [i for i in range(meta.num_seqs) if query_lens[i] <= _MAX_KERNEL_QUERY_LEN]
    device = meta.seq_lens.device
    row_seq_lens = [seq_lens[i] - query_lens[i] + 1 + j for i in short_ids
                    for j in range(query_lens[i])]
    block_tables = meta.block_tables[torch.tensor(short_ids, device=device)].repeat_interleave(
        torch.tensor([query_lens[i] for i in short_ids], device=device), dim=0)
    decode = DecodePlan(None, None, block_tables.to(torch.int32),
                        torch.tensor(row_seq_lens, dtype=torch.int32, device=device), kernel)
    if not long_ids:
        return AttentionPlan(None, decode, slice(0), slice(None))
    starts = [0, *itertools.accumulate(query_lens)]

    def rows(seq_ids: list[int]) -> torch.Tensor:
        return torch.tensor([r for i in seq_ids for r in range(starts[i], starts[i + 1])],
                            device=device)

    return AttentionPlan(_prefill_plan(_select(meta, long_ids), query, k_cache), decode,
                         rows(long_ids), rows(short_ids))


def attention_plan(meta: AttentionMetadata, query: torch.Tensor,
                   k_cache: torch.Tensor) -> AttentionPlan:
    plan = meta.derived.get(_DERIVED_KEY)
    if plan is None:
        kernel = cpu_decode.load() if k_cache.device.type == "cpu" else None
        num_prefills, num_prefill_tokens = meta.num_prefills, meta.num_prefill_tokens
        if kernel is not None and any(q <= _MAX_KERNEL_QUERY_LEN
                                      for q in meta.query_lens_cpu[:num_prefills]):
            plan = _kernel_rows_plan(meta, query, k_cache, kernel)
        else:
            plan = AttentionPlan(
                _prefill_plan(meta, query, k_cache) if num_prefills else None,
                _decode_plan(meta, k_cache) if meta.num_decode_tokens else None,
                slice(0, num_prefill_tokens), slice(num_prefill_tokens, None))
        meta.derived[_DERIVED_KEY] = plan
    return plan


def _prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: PrefillPlan, num_prefills: int, scale: float) -> torch.Tensor:
    num_heads, head_size = query.shape[1], query.shape[2]
    if plan.token_rows is not None:
        query = plan.padded_query.index_copy_(0, plan.token_rows, query)
    q = query.view(num_prefills, plan.max_query_len, num_heads, head_size).transpose(1, 2)
    k, v = plan.kv.gather(k_cache, v_cache)  # [P, kv_heads, max_seq_len, head]
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=plan.attn_mask, is_causal=plan.attn_mask is None, scale=scale,
        enable_gqa=num_heads != k.shape[1])  # [P, heads, max_query_len, head]
    out = out.transpose(1, 2).reshape(-1, num_heads, head_size)
    return out if plan.token_rows is None else out.index_select(0, plan.token_rows)


def _decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      plan: DecodePlan, scale: float) -> torch.Tensor:
    if plan.kv is None:
        return cpu_decode.paged_decode_attention(plan.kernel, query, k_cache, v_cache,
                                                 plan.block_tables, plan.seq_lens, scale)
    num_decodes, num_heads, head_size = query.shape
    k, v = plan.kv.gather(k_cache, v_cache)  # [num_decodes, kv_heads, max_seq_len, head]
    # A GQA group's heads become the "query length" of their KV head: no KV expansion.
    q = query.view(num_decodes, k.shape[1], num_heads // k.shape[1], head_size)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.attn_mask, scale=scale)
    return out.reshape(num_decodes, num_heads, head_size)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    check_cache_pair(k_cache, v_cache)
    num_kv_heads, head_size = k_cache.shape[2], k_cache.shape[3]
    if query.shape[1] % num_kv_heads or query.shape[2] != head_size:
        raise ValueError(f"query {tuple(query.shape)} does not fit a cache of {num_kv_heads} KV "
                         f"heads of size {head_size}")
    out_dtype = query.dtype
    query = query.to(k_cache.dtype)
    plan = attention_plan(meta, query, k_cache)
    parts = []
    if plan.prefill is not None:
        parts.append((plan.prefill_rows, _prefill_attention(
            query[plan.prefill_rows], k_cache, v_cache, plan.prefill, plan.prefill.kv.num_seqs,
            scale)))
    if plan.decode is not None:
        parts.append((plan.decode_rows, _decode_attention(
            query[plan.decode_rows], k_cache, v_cache, plan.decode, scale)))
    if not parts:
        return torch.empty_like(query, dtype=out_dtype)
    if len(parts) == 1:
        return parts[0][1].to(out_dtype)
    if isinstance(plan.prefill_rows, slice):
        return torch.cat([part for _, part in parts]).to(out_dtype)
    out = torch.empty_like(query, dtype=out_dtype)
    for rows, part in parts:
        out[rows] = part.to(out_dtype)
    return out


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """Device → host blocks, as the host scatter reads the result at once; host → device goes
    through pinned memory without blocking, ordered on the device's stream."""
    if block_mapping.numel() == 0:
        return
    mapping = block_mapping.to("cpu", torch.long)
    src_ids = mapping[:, 0].to(src.device)
    dst_ids = mapping[:, 1].to(dst.device)
    blocks = src.index_select(1, src_ids)  # [2, n, block_size, kv_heads, head]
    if blocks.device != dst.device:
        is_upload = blocks.device.type == "cpu" and dst.device.type != "cpu"
        if is_upload and torch.cuda.is_available():
            blocks = blocks.pin_memory()
        blocks = blocks.to(dst.device, non_blocking=is_upload)
    dst.index_copy_(1, dst_ids, blocks)


def copy_blocks(kv_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    """Destinations are fresh blocks, never sources, so gather-then-scatter equals pairwise copies."""
    if block_mapping.numel() == 0 or not kv_caches:
        return
    mapping = block_mapping.to(kv_caches[0].device, torch.long)
    src_ids, dst_ids = mapping[:, 0], mapping[:, 1]
    for kv_cache in kv_caches:
        kv_cache.index_copy_(1, dst_ids, kv_cache.index_select(1, src_ids))
