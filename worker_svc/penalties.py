"""Repetition, frequency and presence penalties (vLLM's semantics), counted with one
`scatter_add_` over the flattened ids: no per-token loop, no sync with the device."""

from __future__ import annotations

import itertools

import torch
from pagedserve.worker_svc.host_to_device import to_device


def apply_penalties(
    logits: torch.Tensor,  # [num_rows, vocab_size] float32, modified in place
    token_ids: list[list[int]],  # per row: prompt + outputs so far
    prompt_lens: list[int],
    repetition_penalties: list[float],
    frequency_penalties: list[float],
    presence_penalties: list[float],
) -> torch.Tensor:
    """Repetition counts prompt and output tokens; frequency and presence count the output only."""
    num_rows, vocab_size = logits.shape
    device = logits.device
    seq_lens = [len(ids) for ids in token_ids]
    flat_ids = to_device(list(itertools.chain.from_iterable(token_ids)), torch.long,
                         device)  # [num_tokens]
    seq_lens_t = to_device(seq_lens, torch.long, device)  # [num_rows]
    row_of = torch.repeat_interleave(torch.arange(num_rows, device=device), seq_lens_t,
                                     output_size=flat_ids.numel())  # [num_tokens]
    starts = torch.cumsum(seq_lens_t, dim=0) - seq_lens_t  # [num_rows]
    positions = torch.arange(flat_ids.numel(), device=device) - starts[row_of]  # [num_tokens]
    prompt_lens_t = to_device(prompt_lens, torch.long, device)
    is_output = (positions >= prompt_lens_t[row_of]).to(torch.float32)  # [num_tokens]
    flat_keys = row_of * vocab_size + flat_ids  # [num_tokens]

    seen_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    seen_counts.scatter_add_(0, flat_keys, torch.ones_like(is_output))
    output_counts = torch.zeros(num_rows * vocab_size, dtype=torch.float32, device=device)
    output_counts.scatter_add_(0, flat_keys, is_output)
    seen_counts = seen_counts.view(num_rows, vocab_size)
    output_counts = output_counts.view(num_rows, vocab_size)

    def column(values: list[float]) -> torch.Tensor:  # [num_rows, 1]
        return to_device(values, torch.float32, device).unsqueeze(1)

    if any(p != 1.0 for p in repetition_penalties):
        repetition = column(repetition_penalties)
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits.copy_(torch.where(seen_counts > 0, penalised, logits))
    if any(p != 0.0 for p in frequency_penalties):
        logits.sub_(column(frequency_penalties) * output_counts)
    if any(p != 0.0 for p in presence_penalties):
        logits.sub_(column(presence_penalties) * (output_counts > 0).to(torch.float32))
    return logits
