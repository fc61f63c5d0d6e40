"""LLMEngine: the scheduler core wired straight to in-process worker cores (no gRPC); the
scheduler service builds the same EngineCore with worker clients, so steps run ahead here as
there (scheduler_svc/step_window.py, worker_svc/launch_window.py). Tensor parallelism needs a
process per rank, so there the engine drives `pagedserve worker` processes on loopback.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import typing
from typing import Any

from pagedserve.scheduler_svc.engine_core import EngineCore, WorkerHandle
from pagedserve.services.common.config import EngineConfig
from pagedserve.services.common.engine_api import EngineLoad
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.outputs import RequestOutput
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.worker import create_worker

if typing.TYPE_CHECKING:
    from pagedserve.rank_process import RankProcess

logger = logging.getLogger(__name__)


def engine_config_from_kwargs(**kwargs: Any) -> EngineConfig:
    """An EngineConfig from flat field names (`model=`, `block_size=`, ...), as the CLI flags."""
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
        self.config = config
        self.ranks: list[RankProcess] = []
        workers: list[WorkerHandle]
        if config.parallel.tensor_parallel_size > 1:
            from pagedserve.rank_process import start_ranks  # gRPC only for tensor parallelism

            atexit.register(self.close)
            self.ranks = start_ranks(config)
            workers = list(self.ranks)
        else:
            workers = [create_worker(config)]
        self._local_workers = [] if self.ranks else workers
        try:
            self.core = EngineCore(config, workers)
        except BaseException:
            self._close_workers()
            raise

    def close(self) -> None:
        """Idempotent: after the steps in flight, the ranks stop and an in-process worker ends
        its model thread and gives its device memory back. Deleting the engine does the same."""
        try:
            self.core.drain()
        finally:
            self._close_workers()

    def _close_workers(self) -> None:
        self._stop_ranks()
        for worker in self._local_workers:
            worker.close()
        self._local_workers = []

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _stop_ranks(self) -> None:
        for rank in self.ranks:
            rank.stop()
        self.ranks.clear()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(engine_config_from_kwargs(**kwargs))

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    is_pooling: bool = False) -> None:
        """A constrained request is added once its grammar is compiled, so no step waits."""
        compiled = self.core.prepare_grammars(sampling)
        if compiled is not None:
            try:
                compiled.result()
            except Exception as exc:  # its first step compiles it, and waits for that
                logger.warning("request %s: its grammar was not compiled ahead: %s", request_id,
                               exc)
        self.core.add_request(request_id, prompt_token_ids, sampling, priority, arrival_time,
                              is_pooling=is_pooling)

    def abort_request(self, request_id: str) -> RequestOutput:
        return self.core.abort_request(request_id)

    def finish_sequence(self, request_id: str, index: int) -> RequestOutput | None:
        """Output `index` ends with STOP (a stop string matched its text); the report if that
        ended the request."""
        return self.core.finish_sequence(request_id, index)

    def step(self) -> list[RequestOutput]:
        return self.core.step()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def get_load(self) -> EngineLoad:
        return self.core.get_load()
