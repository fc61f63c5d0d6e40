"""SamplingParams: vLLM's fields, defaults and validation rules, so users meet no surprise."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from pagedserve.services.common.errors import FieldViolation, InvalidRequest, Reason
from pagedserve.services.common.structured_outputs import StructuredOutputsParams

GREEDY_EPSILON = 1e-5  # temperature below this means greedy
MAX_LOGPROBS = 20
# outside this range float32 logits overflow (5e-324 turns every logprob into NaN)
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 100.0
# bounded so num_output_tokens ** length_penalty stays finite for any max_model_len
MAX_ABS_LENGTH_PENALTY = 10.0
MAX_ABS_LOGIT_BIAS = 100.0  # OpenAI's range
_FLOAT_FIELDS = ("length_penalty", "temperature", "top_p", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty")


class _Violations:
    """Every rule a value breaks, raised at once: one field violation each, the first one's
    message as the error's."""

    def __init__(self) -> None:
        self.found: list[FieldViolation] = []

    def require(self, ok: bool, field: str, message: str) -> None:
        if not ok:
            self.found.append(FieldViolation(field, message))

    def raise_any(self, reason: Reason = Reason.INVALID_SAMPLING_PARAMS) -> None:
        if self.found:
            raise InvalidRequest(self.found[0].description, reason=reason,
                                 violations=self.found)


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
    # {token_id: bias} added to the logits before sampling; kept as (token_id, bias) pairs
    logit_bias: Mapping[int, float] | tuple[tuple[int, float], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # None = every token; else only these
    bad_words: tuple[str, ...] = ()  # never generated; the gateway tokenizes them into:
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens
    # the output follows this constraint; the worker masks every other token
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        # lists become tuples so instances stay hashable
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple(sorted(dict(self.logit_bias).items())))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        object.__setattr__(self, "bad_words", tuple(self.bad_words))
        object.__setattr__(self, "bad_words_token_ids",
                           tuple(tuple(ids) for ids in self.bad_words_token_ids))
        self._verify()

    @property
    def num_candidates(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    def _verify(self) -> None:
        check = _Violations()
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            check.require(isinstance(value, (int, float)) and math.isfinite(value), name,
                          f"{name} must be a finite number, got {value!r}")
        check.raise_any()  # the rules below compare these numbers
        check.require(self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        check.require(self.best_of is None or self.best_of >= self.n, "best_of",
                      f"best_of must be >= n, got best_of={self.best_of} and n={self.n}")
        check.require(self.temperature >= 0.0, "temperature",
                      f"temperature must be >= 0, got {self.temperature}")
        check.require(0.0 < self.top_p <= 1.0, "top_p",
                      f"top_p must be in (0, 1], got {self.top_p}")
        check.require(self.top_k == -1 or self.top_k >= 0, "top_k",
                      f"top_k must be -1 (off), 0 (off) or >= 1, got {self.top_k}")
        check.require(0.0 <= self.min_p <= 1.0, "min_p",
                      f"min_p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check.require(-2.0 <= value <= 2.0, name, f"{name} must be in [-2, 2], got {value}")
        check.require(MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY,
                      "repetition_penalty",
                      f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, "
                      f"{MAX_REPETITION_PENALTY}], got {self.repetition_penalty}")
        check.require(abs(self.length_penalty) <= MAX_ABS_LENGTH_PENALTY, "length_penalty",
                      f"length_penalty must be in [-{MAX_ABS_LENGTH_PENALTY}, "
                      f"{MAX_ABS_LENGTH_PENALTY}], got {self.length_penalty}")
        check.require(self.max_tokens >= 1, "max_tokens",
                      f"max_tokens must be at least 1, got {self.max_tokens}")
        check.require(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
                      f"min_tokens must be in [0, max_tokens={self.max_tokens}], "
                      f"got {self.min_tokens}")
        empty = [i for i, s in enumerate(self.stop) if not s]
        check.require(not empty, f"stop[{empty[0] if empty else 0}]",
                      f"stop must not contain an empty string, got {list(self.stop)}")
        negative = [i for i, t in enumerate(self.stop_token_ids) if t < 0]
        check.require(not negative, f"stop_token_ids[{negative[0] if negative else 0}]",
                      f"stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check.require(value is None or 0 <= value <= MAX_LOGPROBS, name,
                          f"{name} must be in [0, {MAX_LOGPROBS}], got {value}")
        self._verify_token_constraints(check)
        if self.use_beam_search:
            check.require(self.num_candidates >= 2, "best_of",
                          f"best_of (the beam width) must be >= 2 for beam search, "
                          f"got {self.num_candidates}")
            check.require(self.is_greedy, "temperature",
                          f"temperature must be 0 for beam search, got {self.temperature}")
        check.raise_any()

    def _verify_token_constraints(self, check: _Violations) -> None:
        bad_bias = [(t, b) for t, b in self.logit_bias
                    if not (isinstance(t, int) and t >= 0 and isinstance(b, (int, float))
                            and math.isfinite(b) and abs(b) <= MAX_ABS_LOGIT_BIAS)]
        check.require(not bad_bias, "logit_bias",
                      f"logit_bias must map token ids >= 0 to biases in [-{MAX_ABS_LOGIT_BIAS}, "
                      f"{MAX_ABS_LOGIT_BIAS}], got {dict(bad_bias[:8])}")
        if self.allowed_token_ids is not None:
            check.require(bool(self.allowed_token_ids), "allowed_token_ids",
                          "allowed_token_ids must not be empty, got []")
            negative = [t for t in self.allowed_token_ids if t < 0]
            check.require(not negative, "allowed_token_ids",
                          f"allowed_token_ids must be >= 0, got {negative[:8]}")
        empty = [i for i, w in enumerate(self.bad_words) if not w.strip()]
        check.require(not empty, f"bad_words[{empty[0] if empty else 0}]",
                      f"bad_words must not contain an empty word, got {list(self.bad_words)}")
        check.require(all(ids and min(ids) >= 0 for ids in self.bad_words_token_ids),
                      "bad_words_token_ids", "bad_words_token_ids must be non-empty lists of "
                      f"ids >= 0, got {[list(ids) for ids in self.bad_words_token_ids][:8]}")
        check.require(self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= 1,
                      "truncate_prompt_tokens",
                      "truncate_prompt_tokens must be at least 1, got "
                      f"{self.truncate_prompt_tokens}")

    @property
    def has_token_constraints(self) -> bool:
        """A logit bias, an allow list or bad words: what the sampler applies per sequence."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    def verify_for_model(self, vocab_size: int) -> None:
        """One violation per unknown id."""
        lists = (("stop_token_ids", self.stop_token_ids),
                 ("logit_bias", [t for t, _ in self.logit_bias]),
                 ("allowed_token_ids", self.allowed_token_ids or ()),
                 ("bad_words_token_ids", [max(ids) for ids in self.bad_words_token_ids]))
        for name, ids in lists:
            bad = [(i, t) for i, t in enumerate(ids) if t >= vocab_size]
            if bad:
                raise InvalidRequest(
                    f"{name} must be < vocab_size={vocab_size}, got {[t for _, t in bad][:8]}",
                    reason=Reason.UNKNOWN_TOKEN_ID,
                    violations=[FieldViolation(f"{name}[{i}]" if name != "logit_bias"
                                               else f"logit_bias[{t}]",
                                               f"{t} is not below vocab_size={vocab_size}")
                                for i, t in bad[:8]])
