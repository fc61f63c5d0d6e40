"""Linear layers at decode batch sizes on CPU (csrc/skinny_linear_cpu.cpp): fp32, and bf16 on
CPUs with AVX512-BF16, 1 to `MAX_ROWS[dtype]` rows, weights read in place (`bench.cpu_linear` times
both ways). Larger inputs (prefills), other dtypes and devices, and hosts where the kernel
cannot be built or has no AVX-512 take F.linear."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "skinny_linear_cpu.cpp"
EXTENSION_NAME = "pagedserve_skinny_linear_cpu"
# past these, the library's product wins: BLAS's packed fp32 one, oneDNN's bf16 one (AMX where
# the CPU has it) from between 8 and 16 rows (cpu_linear-cpu.json, cpu_linear-cpu-bf16.json)
MAX_ROWS = {torch.float32: 32, torch.bfloat16: 8}


@functools.cache
def load() -> ModuleType | None:
    kernel = cpu_extension.build(EXTENSION_NAME, SOURCE)
    return kernel if kernel is not None and kernel.has_vector_path() else None


@functools.cache
def max_rows() -> dict[torch.dtype, int]:
    """The dtypes the kernel takes on this host, each with its most rows (a copy of MAX_ROWS
    that benches and tests may narrow)."""
    kernel = load()
    if kernel is None:
        return {}
    return {dtype: rows for dtype, rows in MAX_ROWS.items()
            if dtype == torch.float32 or kernel.has_bf16_path()}


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear's contract. x: [num_rows, in_features]; weight: [out_features, in_features]."""
    if (not x.is_cpu or x.dim() != 2 or not 0 < x.shape[0] <= max_rows().get(x.dtype, 0)
            or weight.dtype != x.dtype
            or not weight.is_contiguous() or torch.is_grad_enabled()):
        return F.linear(x, weight, bias)
    kernel = load()
    if kernel is None:
        return F.linear(x, weight, bias)
    out = x.new_empty(x.shape[0], weight.shape[0])
    kernel.skinny_linear(out, x.contiguous(), weight)
    return out if bias is None else out.add_(bias)


if __name__ == "__main__":  # `make install` builds it once, ahead of the first test or server
    logging.basicConfig(level=logging.INFO)
    kernel = load()
    logger.info("CPU linear kernel: %s", kernel.__file__ if kernel else "not built")
