"""Rotary embeddings (neox / HF `rotate_half` layout). cos/sin are cached in float32 and cast at
lookup, as HF does. Off CPU, `Attention` rotates query and key in the kernel that writes the
K/V cache (`kernels.layer_ops.rotary_write_kv`), from the same table."""

from __future__ import annotations

import math
from typing import Any

import torch
from pagedserve.services.common.errors import ConfigError
from pagedserve.worker_svc.layers.fused import FusedLayer


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are stretched by `factor`, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(FusedLayer):
    def __init__(self, head_size: int, max_position: int, base: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_size = head_size
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        inv_freq = 1.0 / (base ** (torch.arange(0, head_size, 2, dtype=torch.float32) / head_size))
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type != "default":
            raise ConfigError(f"rope scaling must be one of ['default', 'linear', 'llama3'], "
                              f"got {rope_type!r}")
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_position, head_size / 2]
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_position, head_size]
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x: [num_tokens, num_heads, head_size]; cos, sin: [num_tokens, 1, head_size / 2]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: [num_tokens]; query, key: [num_tokens, heads * head_size] →
        [num_tokens, heads, head_size]."""
        num_tokens = positions.shape[0]
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
        query = self._rotate(query.view(num_tokens, -1, self.head_size), cos, sin)
        key = self._rotate(key.view(num_tokens, -1, self.head_size), cos, sin)
        return query, key


def rope_settings(hf_config: Any) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, scaling) from transformers v5 `rope_parameters` or the older pair."""
    params = getattr(hf_config, "rope_parameters", None)
    if params:
        return float(params.get("rope_theta", 10000.0)), dict(params)
    scaling = getattr(hf_config, "rope_scaling", None)
    return float(getattr(hf_config, "rope_theta", 10000.0)), (dict(scaling) if scaling else None)
