"""AttentionMetadata: how a flattened batch (prefill chunks first, then one token per decode)
maps onto the paged KV cache. Sequence i's query rows query_start_loc[i]:query_start_loc[i+1] sit
at its last query_len_i positions, up to seq_lens[i] - 1."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token, -1 = skip
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: cu_seqlens_q
    max_query_len: int
    max_seq_len: int
    num_prefills: int  # the first num_prefills sequences have query_len > 1 or cached context
    num_prefill_tokens: int
    query_lens_cpu: list[int]  # host copies, so backends never sync to read shapes
    seq_lens_cpu: list[int]
    # Backend plans built by the first layer and reused by the rest: valid because a metadata
    # object describes one step and is never mutated.
    derived: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_seqs - self.num_prefills
