"""The C++ decode-attention kernel for CPU (csrc/paged_decode_cpu.cpp): reads each sequence's
K/V blocks in place. Compiled on first use (`cpu_extension`); where nothing can build it,
`load()` is None and the torch backend gathers K/V for SDPA instead."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch
from pagedserve.kernels import cpu_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
EXTENSION_NAME = "pagedserve_paged_decode_cpu"


@functools.cache
def load() -> ModuleType | None:
    return cpu_extension.build(EXTENSION_NAME, SOURCE)


def paged_decode_attention(kernel: ModuleType, query: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, block_tables: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """kernel: what `load()` returned. query: [num_seqs, num_heads, head_size], one token per
    sequence at position seq_lens[i] - 1 (its K/V already written); block_tables:
    [num_seqs, >= blocks] int32; seq_lens: [num_seqs] int32. Returns the query's shape."""
    query = query.contiguous()
    out = torch.empty_like(query)
    kernel.paged_decode_attention(out, query, k_cache, v_cache, block_tables, seq_lens, scale)
    return out


if __name__ == "__main__":  # `make install` builds it once, ahead of the first test or server
    logging.basicConfig(level=logging.INFO)
    kernel = load()
    logger.info("CPU decode kernel: %s", kernel.__file__ if kernel else "not built")
