"""Tensor-parallel ranks of the in-process engine: one `pagedserve worker` process per rank on
loopback, driven through worker clients as the scheduler service drives its workers. Loopback is
still reachable by every local user, so the ranks take only this process as a client: mutual TLS
with certificates of a throw-away CA, removed when the ranks stop. This process drives them as
their scheduler, so its certificate has the scheduler's role."""

from __future__ import annotations

import logging
import subprocess
from typing import Any

from pagedserve.certificates import ThrowAwayCertificates
from pagedserve.scheduler_svc.worker_client import WorkerClient
from pagedserve.services.common.config import EngineConfig, SchedulerServiceConfig
from pagedserve.services.common.step_plan import WorkerInfo
from pagedserve.services.rpc.roles import SCHEDULER, WORKER
from pagedserve.supervisor import (
    config_to_argv,
    free_port,
    service_command,
    service_env,
    with_loopback_rendezvous,
)

logger = logging.getLogger(__name__)


def start_ranks(config: EngineConfig) -> list[RankProcess]:
    rank_config = with_loopback_rendezvous(config)
    certificates = ThrowAwayCertificates((SCHEDULER, WORKER))
    return [RankProcess(rank_config, rank, certificates)
            for rank in range(config.parallel.tensor_parallel_size)]


class RankProcess:
    """A WorkerClient plus its process. A rank that exited is started again by the engine's
    rebuild (load_model), as Kubernetes or `pagedserve serve` would restart it."""

    def __init__(self, config: EngineConfig, rank: int,
                 certificates: ThrowAwayCertificates) -> None:
        port = free_port()
        self.certificates = certificates
        self.argv = service_command("worker", [
            *config_to_argv(config), "--port", str(port), "--rank", str(rank),
            "--internal-tls-dir", certificates.tls(WORKER).internal_tls_dir,
            "--log-level", "WARNING"])
        self.process = self._spawn()
        timeouts = SchedulerServiceConfig()
        self.client = WorkerClient(f"127.0.0.1:{port}", config, timeouts.step_timeout_s,
                                   timeouts.startup_timeout_s, certificates.tls(SCHEDULER))

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
        self.certificates.remove()  # shared by the ranks, which all stop together
