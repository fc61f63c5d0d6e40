"""AttentionMetadata: how a flattened batch maps onto the paged KV cache.

The batch is the concatenation of every scheduled sequence's new tokens, prefill chunks first,
then decode tokens (one each). Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1];
those tokens sit at positions seq_lens[i] - query_len_i … seq_lens[i] - 1 of the sequence, and
attend causally to every earlier position through the sequence's block table.
"""

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
    # Per-step tensors a backend derives from the fields above (gather indices, masks, launch
    # plans): built by the first layer's call and reused by every later layer of the same step.
    # Valid because a metadata object describes one step and is not mutated after it is built.
    derived: dict[str, object] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_seqs - self.num_prefills
