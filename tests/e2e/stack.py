"""The three services in this process, over loopback on free ports: worker, scheduler (its
engine talks to the worker over gRPC) and gateway, on one background event loop."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.scheduler_svc.servicer import SchedulerServicer, start_scheduler, stop_scheduler
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    MetricsConfig,
    ModelConfig,
    SchedulerServiceConfig,
    TlsConfig,
    WorkerServiceConfig,
)
from pagedserve.services.gateway.app import Gateway, start_gateway
from pagedserve.services.gateway.config import GatewayConfig, HttpConfig
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.server import ServiceServer
from pagedserve.services.rpc.tls import internal_channel
from pagedserve.worker_svc.servicer import WorkerServicer, start_worker

from pagedserve.certificates import ThrowAwayCertificates
from tests.e2e.background import BackgroundLoop


@dataclass(slots=True)
class Stack:
    loop: BackgroundLoop
    worker: tuple[ServiceServer, WorkerServicer]
    scheduler: tuple[ServiceServer, SchedulerServicer]
    gateway: Gateway
    client_tls: TlsConfig | None = None  # what `load` shows the scheduler, with TLS on

    @property
    def gateway_address(self) -> str:
        return f"127.0.0.1:{self.gateway.port}"

    @property
    def http_url(self) -> str:
        """The OpenAI-compatible HTTP API's base URL (its /v1 is the OpenAI clients' base_url)."""
        return f"{self.gateway.http.scheme}://127.0.0.1:{self.gateway.http_port}"

    @property
    def scheduler_address(self) -> str:
        return f"127.0.0.1:{self.scheduler[0].port}"

    def metrics_ports(self) -> dict[str, int]:
        servers = {"worker": self.worker[1].metrics_server,
                   "scheduler": self.scheduler[1].metrics_server,
                   "gateway": self.gateway.metrics_server}
        return {name: server.port for name, server in servers.items() if server is not None}

    @property
    def worker_address(self) -> str:
        return f"127.0.0.1:{self.worker[0].port}"

    def load(self) -> scheduler_pb2.GetLoadResponse:
        with internal_channel(self.scheduler_address, self.client_tls) as channel:
            return scheduler_pb2_grpc.SchedulerServiceStub(channel).GetLoad(
                scheduler_pb2.GetLoadRequest(), timeout=10)

    def __enter__(self) -> Stack:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        async def stop() -> None:
            await self.gateway.stop(grace_s=0)
            await stop_scheduler(*self.scheduler)
            await self.worker[0].shutdown(0)
            self.worker[1].close()

        self.loop.run(stop())
        self.loop.close()


def start_stack(config: EngineConfig, step_timeout_s: float = 30.0,
                startup_timeout_s: float = 120.0,
                certificates: ThrowAwayCertificates | None = None,
                metrics_port: int = -1, stats_interval_s: float = 0.0, **gateway_kw) -> Stack:
    """`certificates` (roles gateway, scheduler, worker): mutual TLS between the three, and
    `load` calls the scheduler as a gateway. `metrics_port` 0: each service serves /metrics on
    a free port (see `metrics_ports`). `gateway_kw`: more GatewayConfig fields (`http` defaults
    to the HTTP API on a free port, no API key)."""
    loop = BackgroundLoop()

    def tls(role: str) -> TlsConfig:
        return TlsConfig() if certificates is None else certificates.tls(role)

    async def start() -> Stack:
        worker = await start_worker(config, WorkerServiceConfig(
            port=0, tls=tls("worker"), metrics=MetricsConfig(metrics_port)))
        scheduler_config = SchedulerServiceConfig(
            port=0, worker_addresses=[f"127.0.0.1:{worker[0].port}"],
            step_timeout_s=step_timeout_s, startup_timeout_s=startup_timeout_s,
            tls=tls("scheduler"), metrics=MetricsConfig(metrics_port),
            stats_interval_s=stats_interval_s)
        scheduler = await start_scheduler(config, scheduler_config)
        gateway = await start_gateway(GatewayConfig(
            port=0, scheduler_address=f"127.0.0.1:{scheduler[0].port}", tls=tls("gateway"),
            metrics=MetricsConfig(metrics_port),
            **{"http": HttpConfig(http_port=-1), **gateway_kw}))
        return Stack(loop, worker, scheduler, gateway, tls("gateway"))

    try:
        return loop.run(start())
    except BaseException:
        loop.close()
        raise


def tiny_config(model_dir, kv_cache_memory_gib: float = 0.01,
                swap_space_gib: float = 0.01) -> EngineConfig:
    """The model on the CPU with a small KV cache (room for the tiny model's tests)."""
    return EngineConfig(model=ModelConfig(model=str(model_dir)),
                        cache=CacheConfig(kv_cache_memory_gib=kv_cache_memory_gib,
                                          swap_space_gib=swap_space_gib),
                        device=DeviceConfig(device="cpu"))


def assert_idle(stack, timeout_s: float = 2.0) -> scheduler_pb2.GetLoadResponse:
    """Every block free and no request left; the abort of a cancelled call runs before the
    next engine step, so this holds within a step or two."""
    deadline = time.monotonic() + timeout_s
    while True:
        load = stack.load()
        if (load.num_gpu_blocks_used, load.num_cpu_blocks_used, load.num_running_requests,
                load.num_waiting_requests, load.num_swapped_requests) == (0, 0, 0, 0, 0):
            return load
        assert time.monotonic() < deadline, f"blocks or requests still held: {load}"
        time.sleep(0.02)
