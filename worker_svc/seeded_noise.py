"""Seeded sampling noise: counter-based, so every seeded draw of a step comes from one pass of
integer ops with no generator, no per-row call and no host sync.

A draw is keyed by (seed, position, sample index): `draw_keys` hashes the three into a 32-bit
key on the host. Token t's uniform is mix32(token_hashes[t] ^ key), token_hashes[t] being
mix32 of t. The values are 32-bit lanes held in int64 and multiplied by constants below 2**31,
so no product passes 2**63: no overflow, and every shift sees a nonnegative value. The uniforms
are therefore bit-identical on every device; the exponential is -log1p(-u) of them."""

from __future__ import annotations

import torch

_MASK_32 = (1 << 32) - 1
_MASK_64 = (1 << 64) - 1
_GOLDEN_64 = 0x9E3779B97F4A7C15
# the lowbias32 mixer's constants (hash-prospector), both odd and below 2**31
_MUL_1 = 0x21F0AAAD
_MUL_2 = 0x735A2D97
_TOKEN_SALT = 0x85EBCA6B


def _splitmix64(x: int) -> int:
    x = (x + _GOLDEN_64) & _MASK_64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK_64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK_64
    return x ^ (x >> 31)


def _step_seed(seed: int, num_tokens: int) -> int:
    """Hashed, not seed + num_tokens, so siblings whose seeds differ by one do not replay each
    other's noise one step apart."""
    return _splitmix64(_splitmix64(seed & _MASK_64) ^ num_tokens)


def draw_keys(seeds: list[int], positions: list[int], num_samples: list[int],
              stream: int = 0) -> list[int]:
    """Per draw, row by row and sample by sample: the key of (seed, position, sample index),
    the sample index's output of the splitmix64 stream that starts at _step_seed ^ stream (a
    stream other than 0: noise of its own for another use of the same draw)."""
    keys = []
    for seed, position, n in zip(seeds, positions, num_samples, strict=True):
        start = _step_seed(seed, position) ^ stream
        keys.extend(_splitmix64(start + j * _GOLDEN_64) >> 32 for j in range(n))
    return keys


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on values in [0, 2**32) held in int64."""
    x.bitwise_xor_(x >> 16).mul_(_MUL_1).bitwise_and_(_MASK_32)
    x.bitwise_xor_(x >> 15).mul_(_MUL_2).bitwise_and_(_MASK_32)
    return x.bitwise_xor_(x >> 15)


class SeededNoise:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        # [vocab_size] int64 in [0, 2**32)
        self._token_hashes = _mix32_(torch.arange(vocab_size, dtype=torch.long, device=device)
                                     .bitwise_xor_(_TOKEN_SALT))

    def uniform_bits(self, keys: torch.Tensor) -> torch.Tensor:
        """keys: [num_draws] int64 from draw_keys → [num_draws, vocab_size] int64, the 32 random
        bits of each (draw, token)."""
        return _mix32_(self._token_hashes ^ keys.unsqueeze(1))

    def uniforms(self, keys: torch.Tensor) -> torch.Tensor:
        """keys: [num_draws] int64 from draw_keys → [num_draws] float64 in [0, 1), one a key (the
        bits of token 0)."""
        return _mix32_(keys ^ self._token_hashes[0]).to(torch.float64).mul_(2.0 ** -32)

    def exponential(self, keys: torch.Tensor) -> torch.Tensor:
        """keys: [num_draws] int64 from draw_keys → [num_draws, vocab_size] float32 Exponential(1)
        noise, 0 where the bits are 0 (a caller that divides by it clamps it)."""
        # u = bits / 2**32 in [0, 1): log1p(-u) keeps the small noise, which decides rare tokens,
        # to 32 bits instead of float32's 24 bits next to 1
        return self.uniform_bits(keys).to(torch.float32).mul_(-2.0 ** -32).log1p_().neg_()
