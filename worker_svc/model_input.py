"""One step's flattened batch, built with numpy: Python work is per sequence, never per token."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch
from pagedserve.kernels.metadata import AttentionMetadata
from pagedserve.services.common.cdiv import cdiv
from pagedserve.worker_svc.block_table_rows import BlockTableRows
from pagedserve.worker_svc.host_to_device import to_device_many
from pagedserve.worker_svc.pooler import PoolSpan
from pagedserve.worker_svc.sequence_mirrors import CachedSequence


@dataclass(slots=True)
class PromptLogprobSpan:
    """Logits rows [start, start + len(target_ids)) predict target_ids of one sequence's prompt."""

    seq: CachedSequence
    start: int
    target_ids: list[int]


@dataclass(slots=True)
class ModelInput:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    # the sampled sequences' last rows (a sequence with k drafts: its last k + 1), then
    # prompt-logprob rows
    logits_indices: torch.Tensor  # [num_logits_rows] int64
    is_every_row_a_logits_row: bool  # logits_indices = 0, 1, ..., num_tokens - 1 (decodes)
    sample_seqs: list[CachedSequence]  # in logits row order
    prompt_logprob_spans: list[PromptLogprobSpan]
    # (input row, index into the step in flight's draws): tokens the host has not read yet
    drawn_rows: list[tuple[int, int]]
    # the same on the device: [num_drawn_rows] int64 each
    drawn_index: torch.Tensor
    drawn_sources: torch.Tensor
    pool_spans: list[PoolSpan] = field(default_factory=list)  # embedding requests' chunks

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def take_draws(self, draws: torch.Tensor) -> None:
        """The drawn rows' tokens from the step in flight's draws, on the device."""
        self.input_ids[self.drawn_index] = draws[self.drawn_sources]


def build_model_input(seqs: list[CachedSequence], block_size: int, device: torch.device,
                      drawn: dict[int, int] | None = None,
                      block_rows: BlockTableRows | None = None) -> ModelInput:
    """seqs: prefills first. drawn: seq_id → index into the draws of the step in flight, for
    sequences whose last token is still being drawn there (the row is left 0 for the caller).
    block_rows: where the sequences' block tables are rows already (the mirrors')."""
    num_seqs = len(seqs)
    query_lens = np.fromiter((s.num_scheduled_tokens for s in seqs), np.int64, num_seqs)
    context_lens = np.fromiter((s.num_computed_tokens for s in seqs), np.int64, num_seqs)
    seq_lens = context_lens + query_lens
    query_start_loc = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(query_lens, out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    input_ids, drawn_rows = _input_ids(seqs, query_start_loc, drawn)
    seq_index = np.repeat(np.arange(num_seqs), query_lens)  # [num_tokens]
    positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1] - context_lens, query_lens)
    block_tables = _block_tables(seqs, seq_lens, block_size, block_rows)
    slot_mapping = (block_tables[seq_index, positions // block_size].astype(np.int64) * block_size
                    + positions % block_size)

    sample_rows, logits_indices = _logits_rows(seqs, query_start_loc)
    spans = _prompt_logprob_spans(seqs, query_start_loc, logits_indices)

    drawn_index, drawn_sources = ([row for row, _ in drawn_rows],
                                  [source for _, source in drawn_rows])
    (input_ids_t, positions_t, logits_indices_t, drawn_index_t, drawn_sources_t, slot_mapping_t,
     block_tables_t, seq_lens_t, query_start_loc_t) = to_device_many(
        [(input_ids, torch.int64), (positions, torch.int64), (logits_indices, torch.int64),
         (drawn_index, torch.int64), (drawn_sources, torch.int64), (slot_mapping, torch.int64),
         (block_tables, torch.int32), (seq_lens, torch.int32), (query_start_loc, torch.int32)],
        device)
    num_prefills = sum(1 for s in seqs if s.is_prefill)
    query_lens_list = query_lens.tolist()
    seq_lens_list = seq_lens.tolist()
    meta = AttentionMetadata(
        slot_mapping=slot_mapping_t,
        block_tables=block_tables_t,
        seq_lens=seq_lens_t,
        query_start_loc=query_start_loc_t,
        max_query_len=max(query_lens_list, default=0),
        max_seq_len=max(seq_lens_list, default=0),
        num_prefills=num_prefills,
        num_prefill_tokens=int(query_start_loc[num_prefills]),
        query_lens_cpu=query_lens_list,
        seq_lens_cpu=seq_lens_list,
    )
    return ModelInput(
        input_ids=input_ids_t,
        positions=positions_t,
        meta=meta,
        logits_indices=logits_indices_t,
        is_every_row_a_logits_row=logits_indices == list(range(num_tokens)),
        sample_seqs=[seqs[i] for i in sample_rows],
        prompt_logprob_spans=spans,
        drawn_rows=drawn_rows,
        drawn_index=drawn_index_t,
        drawn_sources=drawn_sources_t,
        pool_spans=[PoolSpan(s, int(query_start_loc[i]), int(query_start_loc[i + 1]),
                             s.is_prompt_done) for i, s in enumerate(seqs) if s.pooling_type],
    )


def _logits_rows(seqs: list[CachedSequence], query_start_loc: np.ndarray
                 ) -> tuple[list[int], list[int]]:
    """The sampled sequences, and their rows: the last token's (a sequence with k drafts: its
    last k + 1)."""
    sample_rows = [i for i, s in enumerate(seqs) if s.is_sampling]
    if any(seqs[i].draft_token_ids for i in sample_rows):
        return sample_rows, [row for i in sample_rows for row in range(
            int(query_start_loc[i + 1]) - 1 - len(seqs[i].draft_token_ids),
            int(query_start_loc[i + 1]))]
    return sample_rows, [int(query_start_loc[i + 1]) - 1 for i in sample_rows]


def _input_ids(seqs: list[CachedSequence], query_start_loc: np.ndarray,
               drawn: dict[int, int] | None) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """[num_tokens] token ids, and the rows of tokens still being drawn (left 0). Gathered in
    one list, converted once: a numpy write per sequence costs more than its tokens."""
    input_ids: list[int] = []
    drawn_rows = []
    for seq, start, end in zip(seqs, query_start_loc[:-1].tolist(),
                               query_start_loc[1:].tolist(), strict=True):
        nc = seq.num_computed_tokens
        known = seq.token_ids[nc:nc + end - start]
        if seq.draft_token_ids:
            known = known + seq.draft_token_ids
        input_ids += known
        if len(known) < end - start:
            if len(known) + 1 < end - start or drawn is None or seq.seq_id not in drawn:
                raise ValueError(f"seq {seq.seq_id}: its token {nc + len(known)} is neither "
                                 "known nor being drawn")
            drawn_rows.append((end - 1, drawn[seq.seq_id]))
            input_ids.append(0)
    assert len(input_ids) == query_start_loc[-1], (len(input_ids), query_start_loc[-1])
    return np.array(input_ids, np.int64), drawn_rows


def _block_tables(seqs: list[CachedSequence], seq_lens: np.ndarray, block_size: int,
                  block_rows: BlockTableRows | None) -> np.ndarray:
    """[num_seqs, max blocks of a sequence] int32, padded with 0: gathered from block_rows
    where every sequence has its row there; else every table's ids in one flat array, spread
    into the rows by a mask, with no padded list per sequence."""
    num_blocks = cdiv(seq_lens, block_size)  # [num_seqs]
    if block_rows is not None:
        rows = [seq.block_row for seq in seqs]
        if min(rows, default=0) >= 0:
            return block_rows.gather(rows, num_blocks)
    width = int(num_blocks.max(initial=0))
    tables = [seq.block_table for seq in seqs]
    # most tables end at their last token's block: those go in without a copy
    flat = np.fromiter(itertools.chain.from_iterable(
        [t if len(t) == n else t[:n] for t, n in zip(tables, num_blocks.tolist(), strict=True)]),
        np.int32, int(num_blocks.sum()))
    block_tables = np.zeros((len(seqs), width), np.int32)
    block_tables[np.arange(width) < num_blocks[:, None]] = flat  # row-major: each row in order
    return block_tables


def _prompt_logprob_spans(seqs: list[CachedSequence], query_start_loc: np.ndarray,
                          logits_indices: list[int]) -> list[PromptLogprobSpan]:
    """Appends the prompt-logprob rows to logits_indices, one span per sequence that wants them."""
    spans = []
    for i, seq in enumerate(seqs):
        if not seq.wants_prompt_logprobs:
            continue
        # logits at position p predict token p + 1, so the last prompt position predicts none
        nc = seq.num_computed_tokens
        count = min(nc + seq.num_scheduled_tokens, seq.prompt_len - 1) - nc
        spans.append(PromptLogprobSpan(seq, len(logits_indices),
                                       seq.token_ids[nc + 1:nc + 1 + count]))
        row = int(query_start_loc[i])
        logits_indices.extend(range(row, row + count))
    return spans
