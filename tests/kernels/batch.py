"""Random paged batches for kernel tests: a cache with scattered blocks and the metadata of a step.

Unwritten cache slots hold NaN, so a kernel that reads past a sequence's length (or through the
0-padding of a block table) poisons its output instead of passing by luck.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pagedserve.kernels import ref
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.cdiv import cdiv

# (context_len, query_len): context_len tokens are already cached, query_len are new this step.
SeqSpec = tuple[int, int]

# Named step shapes; prefill specs come first, then decodes (query_len 1).
BATCH_KINDS: dict[str, tuple[list[SeqSpec], list[SeqSpec]]] = {
    "fresh_prefills": ([(0, 9), (0, 9)], []),
    "chunked_prefill": ([(17, 8)], []),
    "decodes": ([], [(49, 1), (5, 1), (16, 1), (31, 1)]),
    "mixed": ([(0, 6), (13, 5), (0, 1)], [(24, 1), (2, 1), (40, 1)]),
}


@dataclass(slots=True)
class PagedBatch:
    query: torch.Tensor  # [num_tokens, num_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size] K of the new tokens
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size], new tokens written
    v_cache: torch.Tensor
    meta: AttentionMetadata
    dense_keys: list[torch.Tensor]  # per sequence [seq_len, num_kv_heads, head_size]
    dense_values: list[torch.Tensor]


def make_metadata(specs: list[SeqSpec], num_prefills: int, block_tables: list[list[int]],
                  block_size: int, device: torch.device) -> AttentionMetadata:
    max_num_blocks = max(len(t) for t in block_tables)
    padded = [t + [0] * (max_num_blocks - len(t)) for t in block_tables]
    slot_mapping, query_start_loc = [], [0]
    for (context_len, query_len), table in zip(specs, block_tables, strict=True):
        for pos in range(context_len, context_len + query_len):
            slot_mapping.append(table[pos // block_size] * block_size + pos % block_size)
        query_start_loc.append(query_start_loc[-1] + query_len)
    query_lens = [q for _, q in specs]
    seq_lens = [c + q for c, q in specs]
    return AttentionMetadata(
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=device),
        block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_prefills=num_prefills,
        num_prefill_tokens=sum(query_lens[:num_prefills]),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def make_batch(prefills: list[SeqSpec], decodes: list[SeqSpec], *, block_size: int,
               num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype,
               device: torch.device | str = "cpu", seed: int = 0,
               num_spare_blocks: int = 3) -> PagedBatch:
    """Cache holding every sequence's context and this step's tokens in shuffled blocks."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    specs = prefills + decodes
    blocks_needed = [cdiv(c + q, block_size) for c, q in specs]
    num_blocks = sum(blocks_needed) + num_spare_blocks
    order = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables, start = [], 0
    for n in blocks_needed:
        block_tables.append(order[start:start + n])
        start += n

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    cache_shape = (num_blocks, block_size, num_kv_heads, head_size)
    k_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    v_cache = torch.full(cache_shape, float("nan"), dtype=dtype, device=device)
    dense_keys = [randn(c + q, num_kv_heads, head_size) for c, q in specs]
    dense_values = [randn(c + q, num_kv_heads, head_size) for c, q in specs]
    # Write every sequence's full history at once with the reference: one "step" of all tokens.
    history = make_metadata([(0, c + q) for c, q in specs], len(specs), block_tables,
                            block_size, device)
    ref.write_kv(torch.cat(dense_keys), torch.cat(dense_values), k_cache, v_cache,
                 history.slot_mapping)

    meta = make_metadata(specs, len(prefills), block_tables, block_size, device)
    num_tokens = sum(q for _, q in specs)
    return PagedBatch(
        query=randn(num_tokens, num_heads, head_size),
        key=torch.cat([k[c:] for k, (c, _) in zip(dense_keys, specs, strict=True)]),
        value=torch.cat([v[c:] for v, (c, _) in zip(dense_values, specs, strict=True)]),
        k_cache=k_cache, v_cache=v_cache, meta=meta,
        dense_keys=dense_keys, dense_values=dense_values,
    )
