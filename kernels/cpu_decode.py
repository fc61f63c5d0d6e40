"""The C++ decode-attention kernel for CPU (csrc/paged_decode_cpu.cpp): reads each sequence's
K/V blocks in place. Compiled on first use with torch's cpp_extension and cached per machine
(TORCH_EXTENSIONS_DIR); where nothing can build it, `load()` is None and the torch backend
gathers K/V for SDPA instead."""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
EXTENSION_NAME = "pagedserve_paged_decode_cpu"


def _cpu_features() -> str | None:
    """A digest of the host's CPU flags, or None where they cannot be read."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    flags = next((line for line in text.splitlines() if line.startswith("flags")), None)
    return hashlib.sha1(flags.encode()).hexdigest()[:10] if flags else None


@functools.cache
def load() -> ModuleType | None:
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None or shutil.which("ninja") is None:
        logger.info("no %s or ninja: CPU decode attention gathers K/V for SDPA", compiler)
        return None
    # -march=native doubles the kernel's speed; the build is named by the CPU's flags, so a
    # cache shared with another kind of CPU never loads a binary built for this one, and by the
    # source, so checkouts of different versions sharing the cache do not rebuild in turn.
    features = _cpu_features()
    source_digest = hashlib.sha1(SOURCE.read_bytes()).hexdigest()[:10]
    name, cflags = f"{EXTENSION_NAME}_{source_digest}", ["-O3", "-fopenmp"]
    if features is not None:
        name, cflags = f"{name}_{features}", [*cflags, "-march=native"]
    from torch.utils import cpp_extension
    try:
        return cpp_extension.load(name=name, sources=[str(SOURCE)], extra_cflags=cflags,
                                  extra_ldflags=["-fopenmp"])
    except (RuntimeError, OSError, ImportError, subprocess.CalledProcessError) as exc:
        logger.warning("building the CPU decode kernel failed (%s): CPU decode attention "
                       "gathers K/V for SDPA", exc)
        return None


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
