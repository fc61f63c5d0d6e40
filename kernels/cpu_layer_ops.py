"""A decoder layer's elementwise ops on CPU (csrc/layer_ops_cpu.cpp): RMSNorm with and without
the residual add, SiLU-and-mul, and rotary with the K/V cache write, one call each where the
layers' torch code runs several ops. At a decode step's few rows that code's time is dispatch,
not arithmetic. Compiled on first use (`cpu_extension`); where nothing can build it, `load()`
is None and the layers keep their torch code."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from pagedserve.kernels import cpu_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "layer_ops_cpu.cpp"
EXTENSION_NAME = "pagedserve_layer_ops_cpu"


@functools.cache
def load() -> ModuleType | None:
    return cpu_extension.build(EXTENSION_NAME, SOURCE)


if __name__ == "__main__":  # `make install` builds it once, ahead of the first test or server
    logging.basicConfig(level=logging.INFO)
    kernel = load()
    logger.info("CPU layer ops: %s", kernel.__file__ if kernel else "not built")
