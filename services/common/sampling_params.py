"""SamplingParams: vLLM's fields, defaults and validation rules, so users meet no surprise."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.services.common.errors import InvalidRequest

GREEDY_EPSILON = 1e-5  # temperature below this means greedy
MAX_LOGPROBS = 20
# outside this range float32 logits overflow (5e-324 turns every logprob into NaN)
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# bounded so num_output_tokens ** length_penalty stays finite for any max_model_len
MAX_ABS_LENGTH_PENALTY = 10.0
_FLOAT_FIELDS = ("length_penalty", "temperature", "top_p", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise InvalidRequest(message)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    n: int = 1
    best_of: int | None = None  # None = n; the beam width when use_beam_search
    use_beam_search: bool = False
    length_penalty: float = 1.0  # beam search: score = cum_logprob / len ** length_penalty
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token, besides the sampled one
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # lists become tuples so instances stay hashable
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._verify()

    @property
    def num_candidates(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def _verify(self) -> None:
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            _require(isinstance(value, (int, float)) and math.isfinite(value),
                     f"{name} must be a finite number, got {value!r}")
        _require(self.n >= 1, f"n must be at least 1, got {self.n}")
        _require(self.best_of is None or self.best_of >= self.n,
                 f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        _require(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k == -1 or self.top_k >= 0,
                 f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        _require(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _require(-2.0 <= self.presence_penalty <= 2.0,
                 f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _require(-2.0 <= self.frequency_penalty <= 2.0,
                 f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _require(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                 f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                 f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        _require(abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY,
                 f"length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY}, "
                 f"{MAX_ABS_LENGTH_PENALTY}], got {self.length_penalty}")
        _require(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}")
        _require(0 <= self.min_tokens <= self.max_tokens,
                 f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}")
        _require(all(s for s in self.stop), f"stop must not contain an empty string, got {list(self.stop)}")
        _require(all(t >= 0 for t in self.stop_token_ids),
                 f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or 0 <= value <= MAX_LOGPROBS,
                     f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        if self.use_beam_search:
            _require(self.num_candidates >= 2,
                     f"best_of (the beam width) must be >= 2 for beam search, got {self.num_candidates}")
            _require(self.is_greedy,
                     f"temperature must be 0 for beam search, got {self.temperature}")
        elif self.is_greedy:
            _require(self.num_candidates == 1,
                     f"best_of must be 1 when sampling greedily (temperature=0), got {self.num_candidates}")

    def verify_for_model(self, vocab_size: int) -> None:
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        _require(not bad, f"stop_token_ids must be < vocab_size={vocab_size}, got {bad}")
