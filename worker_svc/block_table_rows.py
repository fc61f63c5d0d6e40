"""Every mirrored sequence's block table as a row of one int32 array (vLLM V1's BlockTable),
written where the step's deltas change it. A step's [num_seqs, width] table is then one gather
of rows, whatever the tables' lengths, where flattening the tables' lists costs Python work per
block: ~250 µs a step at 256 decodes, growing with the contexts."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BlockTableRows:
    def __init__(self, num_columns: int, num_rows: int = 64) -> None:
        self.table = np.zeros((num_rows, max(num_columns, 1)), np.int32)
        self._free = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    def take(self) -> int:
        if not self._free:  # twice the rows; the old ones keep their place
            num_rows = len(self.table)
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self._free = list(range(2 * num_rows - 1, num_rows - 1, -1))
        return self._free.pop()

    def release(self, row: int) -> None:
        self._free.append(row)

    def clear(self) -> None:
        self._free = list(range(len(self.table) - 1, -1, -1))

    def write(self, row: int, start: int, block_ids: Sequence[int]) -> None:
        """Block ids from column `start` on; what the row holds past them is never read."""
        end = start + len(block_ids)
        if end > self.table.shape[1]:
            grown = np.zeros((len(self.table), max(end, 2 * self.table.shape[1])), np.int32)
            grown[:, :self.table.shape[1]] = self.table
            self.table = grown
        self.table[row, start:end] = block_ids

    def gather(self, rows: list[int], num_blocks: np.ndarray) -> np.ndarray:
        """[len(rows), max(num_blocks)] int32: each row's first num_blocks ids, padded with 0."""
        width = int(num_blocks.max(initial=0))
        tables = self.table[rows, :width]
        tables[np.arange(width) >= num_blocks[:, None]] = 0
        return tables
