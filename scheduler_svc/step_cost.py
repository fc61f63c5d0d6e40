"""What one more token in a decoding step costs, learned online from the workers' step timings.

A decode step's time is close to a line in the tokens it computes: a fixed part (reading every
weight once, launches, sampling, the host's work) and a part per token (the matmuls' arithmetic,
attention). Where a step is bound by memory (a GPU at small batch, a CPU at batch 1) the line is
flat and a draft token is nearly free; where it is bound by arithmetic (a CPU at batch 8) a
rejected draft costs what an accepted one saves. The line is an exponentially weighted least
squares fit over recent decode-only steps (prefill chunks cost per token on another line)."""

from __future__ import annotations

from dataclasses import dataclass

# the weight an older step keeps per newer one: about the last 50 steps count
_DECAY = 0.98
# below this spread of token counts the slope is not told apart from noise
_MIN_VARIANCE = 0.5


@dataclass(slots=True)
class StepCostModel:
    """Until the token counts have varied, a token is taken to be free: speculation is tried,
    and the steps it makes longer teach the slope."""

    _weight: float = 0.0
    _sum_n: float = 0.0
    _sum_t: float = 0.0
    _sum_nn: float = 0.0
    _sum_nt: float = 0.0

    def record(self, num_tokens: float, time_s: float) -> None:
        self._weight = _DECAY * self._weight + 1.0
        self._sum_n = _DECAY * self._sum_n + num_tokens
        self._sum_t = _DECAY * self._sum_t + time_s
        self._sum_nn = _DECAY * self._sum_nn + num_tokens * num_tokens
        self._sum_nt = _DECAY * self._sum_nt + num_tokens * time_s

    @property
    def has_records(self) -> bool:
        return self._weight > 0.0

    def line(self) -> tuple[float, float]:
        """(fixed_s, per_token_s), both >= 0; (mean time, 0) while the slope is unknown."""
        if not self._weight:
            return 0.0, 0.0
        mean_n = self._sum_n / self._weight
        mean_t = self._sum_t / self._weight
        variance = self._sum_nn / self._weight - mean_n * mean_n
        if variance < _MIN_VARIANCE:
            return mean_t, 0.0
        slope = (self._sum_nt / self._weight - mean_n * mean_t) / variance
        per_token_s = max(0.0, slope)
        return max(0.0, mean_t - per_token_s * mean_n), per_token_s
