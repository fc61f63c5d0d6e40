"""Layers with three implementations: their torch code; on CPU, one C++ call per op
(`kernels.cpu_layer_ops`, where it is built); and fused kernels (`kernels.layer_ops`) everywhere
else: CUDA, and the meta device on which the simulator traces a GPU step."""

from __future__ import annotations

from types import ModuleType

import torch
from pagedserve.kernels import cpu_layer_ops
from torch import nn


class FusedLayer(nn.Module):
    # Off: the torch code on every device, the layers as they were before the fused kernels
    # (the simulator's calibration traces that code).
    enable_fused_kernels: bool = True

    def is_fused(self, x: torch.Tensor) -> bool:
        return self.enable_fused_kernels and not x.is_cpu

    def cpu_kernels(self, x: torch.Tensor) -> ModuleType | None:
        """The C++ ops for x on CPU, or None: off the CPU, where they are not built, turned
        off, or where autograd would need the torch code's graph."""
        if self.enable_fused_kernels and x.is_cpu and not torch.is_grad_enabled():
            return cpu_layer_ops.load()
        return None


def disable_fused_kernels(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FusedLayer):
            module.enable_fused_kernels = False
