"""The three services in this process, over loopback on free ports: worker, scheduler (its
engine talks to the worker over gRPC) and gateway, on one background event loop."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import grpc

from pagedserve.v1 import gateway_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc
from scheduler_svc.servicer import SchedulerServicer, start_scheduler, stop_scheduler
from services.config import (
    EngineConfig,
    GatewayConfig,
    SchedulerServiceConfig,
    WorkerServiceConfig,
)
from services.gateway.app import Gateway, start_gateway
from services.server import ServiceServer
from tests.e2e.background import BackgroundLoop
from worker_svc.servicer import WorkerServicer, start_worker


@dataclass(slots=True)
class Stack:
    loop: BackgroundLoop
    worker: tuple[ServiceServer, WorkerServicer]
    scheduler: tuple[ServiceServer, SchedulerServicer]
    gateway: Gateway

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler[0].port}"

    def generation(self, channel: grpc.Channel) -> gateway_pb2_grpc.GenerationStub:
        return gateway_pb2_grpc.GenerationStub(channel)

    def load(self) -> scheduler_pb2.Load:
        with grpc.insecure_channel(self.scheduler_address) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).GetLoad(
                scheduler_pb2.GetLoadRequest(), timeout=10)

    def close(self) -> None:
        async def stop() -> None:
            await self.gateway.stop(grace_s=0)
            await stop_scheduler(*self.scheduler)
            await self.worker[0].shutdown(0)
            self.worker[1].close()

        self.loop.run(stop())
        self.loop.close()


def start_stack(config: EngineConfig, step_timeout_s: float = 30.0) -> Stack:
    loop = BackgroundLoop()

    async def start() -> Stack:
        worker = await start_worker(config, WorkerServiceConfig(port=0))
        scheduler_config = SchedulerServiceConfig(
            port=0, worker_addresses=[f"127.0.0.1:{worker[0].port}"],
            step_timeout_s=step_timeout_s, startup_timeout_s=120.0)
        scheduler = await start_scheduler(config, scheduler_config)
        gateway = await start_gateway(GatewayConfig(
            port=0, scheduler_address=f"127.0.0.1:{scheduler[0].port}"))
        return Stack(loop, worker, scheduler, gateway)

    try:
        return loop.run(start())
    except BaseException:
        loop.close()
        raise


def with_model(config: EngineConfig, model_dir: str, **model_fields) -> EngineConfig:
    return dataclasses.replace(config, model=dataclasses.replace(
        config.model, model=model_dir, **model_fields))
