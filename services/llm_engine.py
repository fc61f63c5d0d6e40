"""LLMEngine: the scheduler core wired straight to an in-process worker core (no gRPC).

The gRPC scheduler service builds the same EngineCore with worker clients instead; everything
between the two is transport. With tensor_parallel_size N > 1 every rank needs a process of its
own (worker_svc/parallel.py), so the engine starts N `pagedserve worker` processes on loopback
and drives them through worker clients, as the scheduler service does; close() (or the
interpreter's exit) stops them.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import subprocess
import typing
from typing import Any

from scheduler_svc.engine_core import EngineCore, EngineLoad, WorkerLike
from scheduler_svc.outputs import RequestOutput
from services.config import EngineConfig, SchedulerServiceConfig
from services.errors import ConfigError
from services.sampling_params import SamplingParams
from services.step_plan import WorkerInfo
from services.supervisor import (
    config_to_argv,
    free_port,
    service_command,
    service_env,
    with_loopback_rendezvous,
)
from worker_svc.client import GrpcWorker
from worker_svc.worker import Worker

logger = logging.getLogger(__name__)


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


class RankProcess:
    """One tensor-parallel rank as a `pagedserve worker` process on loopback, driven through
    its GrpcWorker (whose methods it has). A rank that exited -- killed, or out of a broken
    group (worker_svc/parallel.py) -- is started again when the engine rebuilds it (the
    handshake's load_model), as Kubernetes or `pagedserve serve` would restart it."""

    def __init__(self, config: EngineConfig, rank: int) -> None:
        port = free_port()
        self.argv = service_command("worker", [*config_to_argv(config), "--port", str(port),
                                               "--rank", str(rank), "--log-level", "WARNING"])
        self.process = self._spawn()
        timeouts = SchedulerServiceConfig()
        self.client = GrpcWorker(f"127.0.0.1:{port}", config, timeouts.step_timeout_s,
                                 timeouts.startup_timeout_s)

    def _spawn(self) -> subprocess.Popen:
        return subprocess.Popen(self.argv, env=service_env())

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def load_model(self) -> WorkerInfo:
        if self.process.poll() is not None:
            logger.warning("worker process %s exited (code %s); starting it again",
                           self.client.address, self.process.returncode)
            self.process = self._spawn()
        return self.client.load_model()

    def stop(self) -> None:
        self.client.close()
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ranks: list[RankProcess] = []
        workers: list[WorkerLike] = [Worker(config)]
        if config.parallel.tensor_parallel_size > 1:
            atexit.register(self.close)
            rank_config = with_loopback_rendezvous(config)
            self.ranks = [RankProcess(rank_config, rank)
                          for rank in range(config.parallel.tensor_parallel_size)]
            workers = list(self.ranks)
        try:
            self.core = EngineCore(config, workers)
        except BaseException:
            self._stop_ranks()
            raise

    def close(self) -> None:
        """Stop the tensor-parallel rank processes, if any, once the step still in flight
        (async scheduling) is done (idempotent)."""
        if self.ranks:
            self.core.drain()
        self._stop_ranks()

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
