"""Several engine replicas (each a worker and its scheduler) behind one gateway, in this process
on one background loop; replicas can be added, removed from the gateway's resolution, or
stopped abruptly (their streams break as a killed scheduler's do)."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from pagedserve.scheduler_svc.servicer import SchedulerServicer, start_scheduler, stop_scheduler
from pagedserve.services.common.config import (
    EngineConfig,
    SchedulerServiceConfig,
    TlsConfig,
    WorkerServiceConfig,
)
from pagedserve.services.gateway.app import Gateway, start_gateway
from pagedserve.services.gateway.config import GatewayConfig, HttpConfig
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.server import ServiceServer
from pagedserve.worker_svc.servicer import WorkerServicer, start_worker

from tests.e2e.background import BackgroundLoop

TARGET = "replicas.test:1"  # the name the gateway resolves to the listed replicas


@dataclass(slots=True)
class Replica:
    worker: tuple[ServiceServer, WorkerServicer]
    scheduler: tuple[ServiceServer, SchedulerServicer]
    is_stopped: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.scheduler[0].port}"

    def load(self) -> scheduler_pb2.GetLoadResponse:
        with grpc.insecure_channel(self.address) as channel:
            return scheduler_pb2_grpc.SchedulerServiceStub(channel).GetLoad(
                scheduler_pb2.GetLoadRequest(), timeout=10)


@dataclass(slots=True)
class ReplicaStack:
    loop: BackgroundLoop
    config: EngineConfig
    replicas: list[Replica]
    gateway: Gateway | None = None
    resolved: list[str] = field(default_factory=list)  # what TARGET resolves to now
    tls: dict[str, TlsConfig] = field(default_factory=dict)  # by role; none = plaintext
    server_name: str = ""  # the name the resolved addresses' certificates carry

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    def add_replica(self, config: EngineConfig | None = None, **scheduler_kw) -> Replica:
        """`config`: another engine config than the stack's (another model); `scheduler_kw`:
        SchedulerServiceConfig fields (a role)."""
        replica = self.loop.run(_start_replica(config or self.config, self.tls.get("worker"),
                                               self.tls.get("scheduler"), **scheduler_kw))
        self.replicas.append(replica)
        self.resolved.append(replica.address)
        return replica

    def unlist(self, replica: Replica) -> None:
        """Gone from the resolution (it keeps running)."""
        self.resolved.remove(replica.address)

    def refresh(self) -> None:
        self.loop.run(self.gateway.replicas.refresh())

    def kill(self, replica: Replica) -> None:
        """Stop its scheduler with no grace: open streams break."""
        replica.is_stopped = True
        self.loop.run(stop_scheduler(*replica.scheduler))

    def close(self) -> None:
        async def stop() -> None:
            if self.gateway is not None:
                await self.gateway.stop(grace_s=0)
            for replica in self.replicas:
                if not replica.is_stopped:
                    await stop_scheduler(*replica.scheduler)
                await replica.worker[0].shutdown(0)
                replica.worker[1].close()

        self.loop.run(stop())
        self.loop.close()


async def _start_replica(config: EngineConfig, worker_tls: TlsConfig | None,
                         scheduler_tls: TlsConfig | None, **scheduler_kw) -> Replica:
    worker = await start_worker(config, WorkerServiceConfig(port=0, tls=worker_tls or TlsConfig()))
    scheduler = await start_scheduler(config, SchedulerServiceConfig(
        port=0, worker_addresses=[f"127.0.0.1:{worker[0].port}"], stats_interval_s=0,
        tls=scheduler_tls or TlsConfig(), **scheduler_kw))
    return Replica(worker, scheduler)


def start_replica_stack(config: EngineConfig, num_replicas: int,
                        tls: dict[str, TlsConfig] | None = None, server_name: str = "",
                        replica_kw: list[dict] | None = None, **gateway_kw) -> ReplicaStack:
    """`tls`: the TlsConfig of each role (worker, scheduler, gateway); `server_name`: what the
    gateway's resolution names each address by (the name certificates carry); `replica_kw`:
    each replica's SchedulerServiceConfig fields. `gateway_kw`: more GatewayConfig fields (the
    HTTP API is off by default)."""
    stack = ReplicaStack(BackgroundLoop(), config, [], tls=tls or {}, server_name=server_name)
    try:
        for i in range(num_replicas):
            stack.add_replica(**(replica_kw[i] if replica_kw else {}))

        async def resolve(target: str) -> dict[str, str]:
            return dict.fromkeys(stack.resolved, stack.server_name)

        stack.gateway = stack.loop.run(start_gateway(GatewayConfig(
            port=0, scheduler_address=TARGET, tls=stack.tls.get("gateway", TlsConfig()),
            **{"http": HttpConfig(http_port=-1), **gateway_kw}), resolve))
    except BaseException:
        stack.close()
        raise
    return stack
