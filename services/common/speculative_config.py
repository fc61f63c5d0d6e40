"""Speculative decoding's settings, given as vLLM's `--speculative-config` JSON object."""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from pagedserve.services.common.errors import ConfigError

METHODS = ("ngram", "draft_model")
# A draft model's catch-up, which the worker runs and the scheduler's choice counts: a proposing
# sequence whose draft KV lags by more than this many tokens (more than a step decodes) catches
# up in a forward of its own before it proposes
MAX_FUSED_CATCH_UP = 8
# and that forward computes at most this many tokens a step, the least behind first: a lagging
# batch catches up over several steps, its sequences proposing nothing until caught up (512 left
# most of a batch of 32 behind for ~30 steps on the simulated H100; 2048 is ~7 ms of a 1B draft
# there)
MAX_CATCH_UP_TOKENS = 2048
_TYPES = {"str": ((str,), "a string"), "int": ((int,), "an integer"),
          "float": ((int, float), "a number"), "bool": ((bool,), "true or false")}


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    method: str = "ngram"
    model: str = ""  # draft_model: the draft's checkpoint dir, of the target's tokenizer
    num_speculative_tokens: int = 4  # the most draft tokens one sequence verifies in a step
    prompt_lookup_max: int = 4  # the longest suffix matched against the earlier tokens
    prompt_lookup_min: int = 2  # the shortest
    # ngram: at most this many drafts per matched token (the match measured as far back as it
    # goes), vLLM's suffix_decoding_max_spec_factor; 0: num_speculative_tokens whatever the match
    prompt_lookup_max_spec_factor: float = 0.0
    adaptive: bool = True  # per-sequence lookahead from its recent acceptance; off when it does not pay
    disable_by_batch_size: int = 0  # no drafts while this many requests run (0: no such limit)

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"speculative_config.method must be one of {list(METHODS)}, "
                              f"got {self.method!r}")
        if (self.method == "draft_model") != bool(self.model):
            raise ConfigError("speculative_config.model names the draft model, needed with "
                              f"method 'draft_model' only; got method={self.method!r} and "
                              f"model={self.model!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ConfigError("speculative_config.num_speculative_tokens must be in [1, 16], "
                              f"got {self.num_speculative_tokens}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ConfigError("speculative_config needs 1 <= prompt_lookup_min <= "
                              f"prompt_lookup_max, got prompt_lookup_min={self.prompt_lookup_min}"
                              f" and prompt_lookup_max={self.prompt_lookup_max}")
        if self.prompt_lookup_max_spec_factor < 0:
            raise ConfigError("speculative_config.prompt_lookup_max_spec_factor must be >= 0 "
                              f"(0: no limit), got {self.prompt_lookup_max_spec_factor}")
        if self.disable_by_batch_size < 0:
            raise ConfigError("speculative_config.disable_by_batch_size must be >= 0 (0: no "
                              f"limit), got {self.disable_by_batch_size}")


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """None for "" or None (speculation off)."""
    if not value:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(f"speculative_config must be a JSON object, got {value!r}: "
                              f"{exc}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"speculative_config must be a JSON object, got {value!r}")
    known = {f.name: f.type for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"speculative_config has unknown keys {unknown}; known: "
                          f"{sorted(known)}")
    for name, item in value.items():
        expected, described = _TYPES[known[name]]
        if type(item) not in expected:
            raise ConfigError(f"speculative_config.{name} must be {described}, got {item!r}")
    return SpeculativeConfig(**value)
