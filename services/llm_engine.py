"""LLMEngine: the scheduler core wired straight to in-process worker cores (no gRPC).

The gRPC scheduler service builds the same EngineCore with worker clients instead; everything
between the two is transport.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

from scheduler_svc.engine_core import EngineCore, EngineLoad
from scheduler_svc.outputs import RequestOutput
from services.config import EngineConfig
from services.errors import ConfigError
from services.sampling_params import SamplingParams
from worker_svc.worker import Worker


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """An EngineConfig from flat field names (`model=`, `block_size=`, `max_num_seqs=`, ...),
    as the CLI flags spell them. Unknown names raise ConfigError naming them."""
    sections: dict[str, dict[str, Any]] = {}
    owner: dict[str, str] = {}
    hints = typing.get_type_hints(EngineConfig)
    for section in dataclasses.fields(EngineConfig):
        for f in dataclasses.fields(hints[section.name]):
            owner[f.name] = section.name
    for name, value in kwargs.items():
        if name not in owner:
            raise ConfigError(f"unknown engine option {name!r} (value {value!r})")
        sections.setdefault(owner[name], {})[name] = value
    return EngineConfig(**{name: hints[name](**values) for name, values in sections.items()})


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        if config.parallel.tensor_parallel_size != 1:
            raise ConfigError(
                f"tensor_parallel_size={config.parallel.tensor_parallel_size} needs one worker "
                "process per rank: use `pagedserve serve --tensor-parallel-size N` (or the "
                "services); the in-process engine runs one worker")
        self.config = config
        self.core = EngineCore(config, [Worker(config)])

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(engine_config_from_kwargs(**kwargs))

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        self.core.add_request(request_id, prompt_token_ids, sampling, priority, arrival_time)

    def abort_request(self, request_id: str) -> RequestOutput:
        return self.core.abort_request(request_id)

    def step(self) -> list[RequestOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_load(self) -> EngineLoad:
        return self.core.get_load()
