"""RMSNorm with vLLM's fused residual add."""

from __future__ import annotations

import torch
from pagedserve.kernels import layer_ops
from pagedserve.worker_svc.layers.fused import FusedLayer
from torch import nn


class RMSNorm(FusedLayer):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # float32 statistics, then the input dtype, like HF, so bf16 matches too
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [..., hidden]. With `residual`, returns (norm(x + residual), x + residual)."""
        if self.is_fused(x):
            if residual is None:
                return layer_ops.rms_norm(x, self.weight, self.eps)
            return layer_ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
        kernels = self.cpu_kernels(x)
        if kernels is not None and x.dim() == 2 and x.dtype == self.weight.dtype:
            if residual is None:
                return kernels.rms_norm(x, self.weight, self.eps)
            return kernels.fused_add_rms_norm(x, residual, self.weight, self.eps)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
