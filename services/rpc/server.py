"""The gRPC server every service shares: grpc.aio with standard Health and reflection, and the
graceful shutdown. Health starts NOT_SERVING; the owner marks it serving when it can take work.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from pagedserve.services.rpc.malformed_requests import MalformedRequestInterceptor
from pagedserve.services.rpc.tracing import server_interceptors

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 64 << 20  # prompts of token ids and prompt logprobs can be large
DEFAULT_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
    ("grpc.so_reuseport", 0),  # two services must never share a port by accident
    # clients ping every 10 s to find a vanished peer during long streams
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # the server pings too: a peer gone without closing its connection (a host lost) is
    # dropped after 80 s, not gRPC's 2 h, and its descriptor freed
    ("grpc.keepalive_time_ms", 60_000),
    ("grpc.keepalive_timeout_ms", 20_000),
)


@dataclass(frozen=True, slots=True)
class ServiceBinding:
    servicer: object
    add_to_server: Callable[[Any, grpc.aio.Server], None]  # add_GenerationServiceServicer_to_server
    name: str  # "pagedserve.v1.GenerationService"


class ServiceServer:
    def __init__(self, servers: Sequence[grpc.aio.Server], port: int,
                 service_names: Sequence[str], health: health_aio.HealthServicer,
                 health_server: grpc.aio.Server | None = None) -> None:
        self.servers = tuple(servers)  # one port; each accepts new calls on its own
        self.port = port
        self.health_server = health_server  # plaintext Health only, for probes without TLS
        self.service_names = tuple(service_names)
        self._health = health
        self._is_draining = False

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    async def start(self) -> None:
        await self.set_serving(False)  # Health's own default for "" is SERVING
        for server in self.servers:
            await server.start()
        if self.health_server is not None:
            await self.health_server.start()
        logger.info("serving %s on port %d (health: NOT_SERVING until ready)",
                    ", ".join(self.service_names), self.port)

    async def set_serving(self, is_serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if is_serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in ("", *self.service_names):
            await self._health.set(name, status)

    async def shutdown(self, grace_s: float, drain: Callable[[], Awaitable[None]] | None = None
                       ) -> None:
        """NOT_SERVING (load balancers stop routing), `is_draining` (owners refuse new work),
        the owner's `drain`, then calls still open after `grace_s` are cancelled."""
        if self._is_draining:
            return
        self._is_draining = True
        await self.set_serving(False)
        await self._health.enter_graceful_shutdown()
        if drain is not None:
            await drain()
        await asyncio.gather(*(server.stop(grace_s) for server in self.servers))
        if self.health_server is not None:
            await self.health_server.stop(0)
        logger.info("server on port %d stopped", self.port)

    async def serve_until_signal(self, grace_s: float,
                                 drain: Callable[[], Awaitable[None]] | None = None) -> None:
        loop = asyncio.get_running_loop()
        stop_requested = asyncio.Event()
        signals = (signal.SIGTERM, signal.SIGINT)
        for sig in signals:
            loop.add_signal_handler(sig, stop_requested.set)
        try:
            await stop_requested.wait()
            logger.info("signal received: draining")
            await self.shutdown(grace_s, drain)
        finally:
            for sig in signals:
                loop.remove_signal_handler(sig)


def _bind(server: grpc.aio.Server, host: str, port: int,
          credentials: grpc.ServerCredentials | None) -> int:
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound_port = (server.add_insecure_port(address) if credentials is None
                  else server.add_secure_port(address, credentials))
    if bound_port == 0:
        raise OSError(f"cannot bind {address}")
    return bound_port


def create_server(bindings: Sequence[ServiceBinding], host: str = "127.0.0.1", port: int = 0,
                  options: Sequence[tuple[str, Any]] = DEFAULT_OPTIONS,
                  credentials: grpc.ServerCredentials | None = None, health_port: int = 0,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = (), num_servers: int = 1
                  ) -> tuple[ServiceServer, int]:
    """Returns the server, not started, and the port it bound (`port` 0: any free one). A
    `health_port` adds a plaintext server with Health alone, for probes that cannot speak TLS
    (its port shared as `options` share the main one).
    `interceptors` (who may call) run first: a call they refuse is never parsed.
    `num_servers` > 1 runs that many grpc.aio servers on the port (SO_REUSEPORT, the kernel
    spreads connections over them): grpc.aio starts one new call per method every few loop
    turns, each server on its own, which on a busy loop is fewer calls than arrive."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    health_reuse_port = dict(options).get("grpc.so_reuseport", 0)
    if num_servers > 1:
        options = [*(o for o in options if o[0] != "grpc.so_reuseport"),
                   ("grpc.so_reuseport", 1)]
    health = health_aio.HealthServicer()
    names = [b.name for b in bindings]
    servers, bound_port = [], port
    for _ in range(num_servers):
        server = grpc.aio.server(options=list(options),
                                 interceptors=[*interceptors, MalformedRequestInterceptor(),
                                               *server_interceptors()])
        for binding in bindings:
            binding.add_to_server(binding.servicer, server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME], server)
        bound_port = _bind(server, host, bound_port, credentials)
        servers.append(server)
    health_server = None
    if health_port:
        health_server = grpc.aio.server(options=[("grpc.so_reuseport", health_reuse_port)])
        health_pb2_grpc.add_HealthServicer_to_server(health, health_server)
        _bind(health_server, host, health_port, None)
    return ServiceServer(servers, bound_port, names, health, health_server), bound_port
