from __future__ import annotations

import torch
import torch.nn.functional as F
from pagedserve.kernels import layer_ops
from pagedserve.worker_svc.layers.fused import FusedLayer
from torch import nn


class SiluAndMul(FusedLayer):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, 2 * intermediate_size] → [num_tokens, intermediate_size]
        if self.is_fused(x):
            return layer_ops.silu_and_mul(x)
        kernels = self.cpu_kernels(x)
        if kernels is not None and x.dim() == 2:
            return kernels.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


_ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "silu": nn.SiLU}


def get_activation(name: str) -> nn.Module:
    if name not in _ACTIVATIONS:
        raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {name!r}")
    return _ACTIVATIONS[name]()
