"""The kernel seam. A backend is a module with the four ops of `kernels.ref` and their
signatures; the worker picks one explicitly by name and imports it lazily, never at import time.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

# name → module implementing write_kv, paged_attention, swap_blocks, copy_blocks
BACKEND_MODULES = {
    "ref": "kernels.ref",
    "torch": "kernels.torch_ops",
    "triton": "kernels.triton_ops",
    "flash_attn": "kernels.flash_attn_ops",
}


def flash_attn_available() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


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
    return importlib.import_module(BACKEND_MODULES[resolve_backend_name(name, device)])
