"""A backend is a module with the four ops of `kernels.ref`, imported lazily by name. Optional:
`prepare(device)` (below) and `warm_up_batches(max_model_len)`, the steps a CUDA worker's warm-up
runs so that its kernels compile then and not while serving (kernels/triton_ops.py)."""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch

BACKEND_MODULES = {
    "ref": "pagedserve.kernels.ref",
    "torch": "pagedserve.kernels.torch_ops",
    "triton": "pagedserve.kernels.triton_ops",
    "flash_attn": "pagedserve.kernels.flash_attn_ops",
}


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def available_backends(device: torch.device) -> list[str]:
    """Triton runs on CPU tensors only under `TRITON_INTERPRET=1`."""
    names = ["ref", "torch"]
    has_triton = importlib.util.find_spec("triton") is not None
    if has_triton and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"):
        names.append("triton")
    if device.type == "cuda" and flash_attn_available():
        names.append("flash_attn")
    return names


def resolve_backend_name(name: str, device: torch.device) -> str:
    """`auto`: flash_attn when installed on CUDA, else triton on CUDA, else the torch backend."""
    if name != "auto":
        if name not in BACKEND_MODULES:
            raise ValueError(f"attention_backend must be one of {['auto', *BACKEND_MODULES]}, got {name!r}")
        return name
    if device.type == "cuda":
        return "flash_attn" if flash_attn_available() else "triton"
    return "torch"


def get_backend(name: str, device: torch.device) -> ModuleType:
    """A backend's optional `prepare(device)` runs here, before the first step: one-time work
    such as compiling a CPU kernel."""
    module = importlib.import_module(BACKEND_MODULES[resolve_backend_name(name, device)])
    prepare = getattr(module, "prepare", None)
    if prepare is not None:
        prepare(device)
    return module
