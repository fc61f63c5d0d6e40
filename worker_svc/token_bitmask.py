"""Allowed-token bitmasks (bit t % 32 of word t // 32 set: token t allowed), applied to logits
before any other processing, so penalties, temperature and top-k/top-p see only allowed tokens."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True, slots=True)
class TokenBitmask:
    rows: list[int]  # logits rows the mask applies to; other rows are left alone
    bits: torch.Tensor  # [len(rows), num_bitmask_words(vocab_size)] int32, on the host

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [num_rows, vocab_size] float32, masked in place."""
        vocab_size = logits.shape[1]
        bits = self.bits.to(logits.device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
        # [len(rows), num_words, 32] → [len(rows), vocab_size]
        allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]
        index = torch.tensor(self.rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
        return logits
