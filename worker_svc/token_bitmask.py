"""Allowed-token bitmasks (bit t % 32 of word t // 32 set: token t allowed), applied to logits
before any other processing, so penalties, temperature and top-k/top-p see only allowed tokens."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from pagedserve.worker_svc.host_to_device import to_device


def num_bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


@dataclass(frozen=True, slots=True)
class TokenBitmask:
    rows: list[int]  # logits rows the mask applies to; other rows are left alone
    bits: torch.Tensor  # [len(rows), num_bitmask_words(vocab_size)] int32, on the host

    def allowed(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """[len(rows), vocab_size] bool. The host unpacks in one numpy pass (a word's bytes in
        memory are its bits 0-7, 8-15, ...: little-endian); a GPU unpacks on the device, so
        only the packed words cross to it."""
        if device.type == "cpu":
            by_bit = np.unpackbits(self.bits.numpy().view(np.uint8), axis=1, bitorder="little")
            return torch.from_numpy(by_bit[:, :vocab_size].view(np.bool_))
        words = self.bits.to(device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        # [len(rows), num_words, 32] → [len(rows), vocab_size]
        return ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab_size]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits: [num_rows, vocab_size] float32, left as they are; the masked copy."""
        allowed = self.allowed(logits.shape[1], logits.device)
        if self.rows == list(range(logits.shape[0])):
            return torch.where(allowed, logits, float("-inf"))
        index = to_device(self.rows, torch.long, logits.device)
        masked = logits.clone()
        masked[index] = torch.where(allowed, logits[index], float("-inf"))
        return masked
