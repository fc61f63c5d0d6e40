"""Layers with two implementations: their torch code, which CPU runs (its own fast path), and
fused kernels (`kernels.layer_ops`) everywhere else: CUDA, and the meta device on which the
simulator traces a GPU step."""

from __future__ import annotations

import torch
from torch import nn


class FusedLayer(nn.Module):
    # Off: the torch code on every device, the layers as they were before the fused kernels
    # (the simulator's calibration traces that code).
    enable_fused_kernels: bool = True

    def is_fused(self, x: torch.Tensor) -> bool:
        return self.enable_fused_kernels and x.device.type != "cpu"


def disable_fused_kernels(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, FusedLayer):
            module.enable_fused_kernels = False
