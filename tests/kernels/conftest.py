"""Backend × device/dtype parametrization shared by the kernel tests.

A test takes `backend` and `target` parameters and the `ops` fixture, which imports the backend
module or skips the case with the reason it cannot run here. CPU runs fp32; CUDA cases (fp16,
bf16) carry the `gpu` marker. Triton runs on CUDA, or on CPU under `TRITON_INTERPRET=1`.
"triton-split" is the Triton backend with a 32-token decode partition and a 1-partition reduce
chunk, so that small CPU cases take the split-KV (flash-decoding) path too, and its reduce
combines several chunks.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch
from pagedserve.kernels.backend import available_backends, get_backend

# Every backend with a fast implementation; "ref" joins only tests with an independent oracle.
FAST_BACKENDS = ["torch", "triton", "triton-split", "flash_attn"]
ALL_BACKENDS = ["ref", *FAST_BACKENDS]
# Ops outside attention are the same code in "triton" and "triton-split".
CACHE_OP_BACKENDS = ["ref", "torch", "triton", "flash_attn"]
SPLIT_PARTITION_SIZE = 32
SPLIT_REDUCE_CHUNK = 1

TARGETS = [
    pytest.param(("cpu", torch.float32), id="cpu-fp32"),
    pytest.param(("cuda", torch.float16), id="cuda-fp16", marks=pytest.mark.gpu),
    pytest.param(("cuda", torch.bfloat16), id="cuda-bf16", marks=pytest.mark.gpu),
]

TOLERANCES = {
    torch.float32: dict(atol=2e-5, rtol=1e-4),
    torch.float16: dict(atol=5e-3, rtol=5e-3),
    torch.bfloat16: dict(atol=3e-2, rtol=3e-2),
}


@pytest.fixture
def device(target) -> torch.device:
    return torch.device(target[0])


@pytest.fixture
def dtype(target) -> torch.dtype:
    return target[1]


@pytest.fixture
def ops(backend: str, device: torch.device, monkeypatch) -> ModuleType:
    if device.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name = "triton" if backend == "triton-split" else backend
    if name not in available_backends(device):
        pytest.skip(f"backend {name} is not available on {device} "
                    f"(triton on CPU needs TRITON_INTERPRET=1; flash_attn needs the package)")
    module = get_backend(name, device)
    if backend == "triton-split":
        monkeypatch.setattr(module, "DECODE_PARTITION_SIZE", SPLIT_PARTITION_SIZE)
        monkeypatch.setattr(module, "REDUCE_CHUNK", SPLIT_REDUCE_CHUNK)
    return module


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """Kernel-test tensors are tiny: intra-op threads add only wake-up latency, badly so on a
    shared 2-core CI machine. Restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
