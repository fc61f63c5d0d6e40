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
import os
import subprocess
import sys
import typing
from typing import Any

from scheduler_svc.engine_core import EngineCore, EngineLoad, WorkerLike
from scheduler_svc.outputs import RequestOutput
from services.config import EngineConfig, SchedulerServiceConfig
from services.errors import ConfigError
from services.sampling_params import SamplingParams
from services.supervisor import config_to_argv, free_port
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


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._rank_processes: list[subprocess.Popen] = []
        self._clients: list[GrpcWorker] = []
        workers: list[WorkerLike] = [Worker(config)]
        if config.parallel.tensor_parallel_size > 1:
            atexit.register(self.close)
            workers = self._start_ranks()
        try:
            self.core = EngineCore(config, workers)
        except BaseException:
            self.close()
            raise

    def _start_ranks(self) -> list[WorkerLike]:
        """One `pagedserve worker` process per rank on loopback, and a client for each."""
        config = dataclasses.replace(self.config, parallel=dataclasses.replace(
            self.config.parallel, distributed_init_address=f"127.0.0.1:{free_port()}"))
        timeouts = SchedulerServiceConfig()
        for rank in range(config.parallel.tensor_parallel_size):
            port = free_port()
            self._rank_processes.append(subprocess.Popen(
                [sys.executable, "-m", "services.cli", "worker", *config_to_argv(config),
                 "--port", str(port), "--rank", str(rank), "--log-level", "WARNING"],
                env={**os.environ, "PYTHONUNBUFFERED": "1", "GRPC_VERBOSITY": "ERROR"}))
            self._clients.append(GrpcWorker(f"127.0.0.1:{port}", config, timeouts.step_timeout_s,
                                            timeouts.startup_timeout_s))
        logger.info("started %d worker processes, one per tensor-parallel rank",
                    len(self._clients))
        return list(self._clients)

    def close(self) -> None:
        """Stop the tensor-parallel rank processes, if any (idempotent)."""
        for client in self._clients:
            client.close()
        for process in self._rank_processes:
            if process.poll() is None:
                process.terminate()
        for process in self._rank_processes:
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._clients.clear()
        self._rank_processes.clear()

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
