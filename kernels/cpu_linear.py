"""Linear layers at decode batch sizes on CPU (csrc/skinny_linear_cpu.cpp): fp32, 1 to
`MAX_ROWS` rows, weights read in place (`bench.cpu_linear` times both ways). Larger inputs
(prefills), other dtypes and devices, and hosts where the kernel cannot be built or has no
AVX-512 take F.linear."""

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
MAX_ROWS = 32  # past this, BLAS's packed product wins


@functools.cache
def load() -> ModuleType | None:
    kernel = cpu_extension.build(EXTENSION_NAME, SOURCE)
    return kernel if kernel is not None and kernel.has_vector_path() else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
           ) -> torch.Tensor:
    """F.linear's contract. x: [num_rows, in_features]; weight: [out_features, in_features]."""
    if (x.device.type != "cpu" or x.dim() != 2 or not 0 < x.shape[0] <= MAX_ROWS
            or x.dtype != torch.float32 or weight.dtype != torch.float32
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
