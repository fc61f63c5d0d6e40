"""The gateway process: wait for a scheduler replica, load the tokenizer of the model it serves, serve
Generation and Models (plus Health and reflection) and the OpenAI-compatible HTTP API, both on
one event loop and one Frontend, until SIGTERM, then drain.

Health stays NOT_SERVING until a scheduler replica answered and the tokenizer is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from pagedserve.services.common.gc_tuning import tune_gc_after_startup
from pagedserve.services.gateway.config import GatewayConfig
from pagedserve.services.gateway.convert import served_model_from_proto
from pagedserve.services.gateway.frontend import Admission, Frontend
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.gateway.openai.routes import build_app
from pagedserve.services.gateway.openai.server import HttpServer, bind_socket
from pagedserve.services.gateway.openai.serving import OpenAIServing
from pagedserve.services.gateway.openai.tools import parser_for_template
from pagedserve.services.gateway.ownership import Ownership
from pagedserve.services.gateway.replica_set import ReplicaSet, Resolver
from pagedserve.services.gateway.servicer import GenerationServicer, ModelServicer
from pagedserve.services.gateway.validation import ServedModel
from pagedserve.services.rpc.auth import ApiKeyInterceptor
from pagedserve.services.rpc.metrics import MetricsServer, start_metrics_server
from pagedserve.services.rpc.server import (
    DEFAULT_OPTIONS,
    ServiceBinding,
    ServiceServer,
    create_server,
)
from pagedserve.services.rpc.tls import public_server_credentials
from pagedserve.services.rpc.v1 import gateway_pb2_grpc
from pagedserve.services.text.tokenizer import Tokenizer
from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

GUARDED_SERVICES = ("pagedserve.v1.GenerationService", "pagedserve.v1.ModelService")


@dataclass(slots=True)
class Gateway:
    server: ServiceServer
    replicas: ReplicaSet
    admission: Admission
    metrics_server: MetricsServer | None = None
    tokenizer_pool: ThreadPoolExecutor | None = None
    tokenize_api_pool: ThreadPoolExecutor | None = None
    http: HttpServer | None = None

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def http_port(self) -> int | None:
        """The OpenAI-compatible HTTP API's port; None when it is off."""
        return self.http.port if self.http is not None else None

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait at most timeout_s for the live ones."""
        self.admission.start_draining()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.admission.wait_idle(), timeout_s)

    async def stop(self, grace_s: float) -> None:
        if self.http is not None:
            await self.http.stop(grace_s)
        await self.server.shutdown(grace_s)
        await self.close_resources()

    async def close_resources(self) -> None:
        """What outlives the gRPC server: replica channels, metrics, tokenizer threads."""
        await self.replicas.close()
        if self.metrics_server is not None:
            self.metrics_server.stop()
        for pool in (self.tokenizer_pool, self.tokenize_api_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)


async def _join_replicas(config: GatewayConfig, resolve: Resolver | None
                         ) -> tuple[ReplicaSet, Tokenizer, ServedModel]:
    """The replica set once one replica serves, with its model's tokenizer and info."""
    replicas = ReplicaSet(config.scheduler_address, config.routing, config.rpc_timeout_s,
                          config.tls, resolve)
    try:
        logger.info("waiting for a scheduler replica at %s", config.scheduler_address)
        await replicas.start()
        served = await replicas.wait_until_serving()
        tokenizer = Tokenizer.from_pretrained(config.tokenizer or served.model)
        if config.http.chat_template:
            tokenizer.use_chat_template(config.http.chat_template)
        info = served_model_from_proto(served, tokenizer.has_chat_template)
    except BaseException:
        await replicas.close()
        raise
    return replicas, tokenizer, info


async def start_gateway(config: GatewayConfig, resolve: Resolver | None = None) -> Gateway:
    """Started and SERVING once a scheduler replica serves (the model is the first one's).
    `resolve`: how scheduler_address targets become replicas (default: DNS)."""
    credentials = public_server_credentials(config.public_tls)  # bad files fail before waiting
    api_key = config.http.resolve_api_key()
    admin_token = config.admin.resolve_admin_token()
    replicas, tokenizer, info = await _join_replicas(config, resolve)
    admission = Admission(config.max_concurrent_requests)
    registry = CollectorRegistry()
    metrics = GatewayMetrics(registry, info.model, info.max_model_len)
    pool = ThreadPoolExecutor(config.num_tokenizer_threads, thread_name_prefix="tokenizer")
    api_pool = ThreadPoolExecutor(config.num_tokenize_api_threads,
                                  thread_name_prefix="tokenize-api")
    frontend = Frontend(tokenizer, replicas, info, admission, metrics, limits=config.limits,
                        executor=pool, ownership=Ownership(api_key, admin_token),
                        tokenize_executor=api_pool)
    server, port = create_server([
        ServiceBinding(GenerationServicer(frontend),
                       gateway_pb2_grpc.add_GenerationServiceServicer_to_server,
                       "pagedserve.v1.GenerationService"),
        ServiceBinding(ModelServicer(info), gateway_pb2_grpc.add_ModelServiceServicer_to_server,
                       "pagedserve.v1.ModelService"),
    ], config.host, config.port, server_options(config),
        credentials=credentials, health_port=config.tls.health_port,
        interceptors=[ApiKeyInterceptor(api_key, GUARDED_SERVICES, admin_token)] if api_key
        else (), num_servers=config.num_grpc_servers)
    http = None
    if config.http.http_port != 0:
        parser = config.http.tool_call_parser or parser_for_template(
            tokenizer.hf_tokenizer.chat_template)
        app = build_app(OpenAIServing(frontend, info.model, parser), api_key,
                        config.http.max_request_body_bytes, admin_token, registry)
        http = HttpServer(app, bind_socket(config.host, max(config.http.http_port, 0),
                                           config.reuse_port),
                          config.public_tls, config.connections)
    await server.start()
    try:
        metrics_server = start_metrics_server(registry, config.host, config.metrics,
                                              "gateway")
    except BaseException:
        await server.shutdown(0)
        await replicas.close()
        pool.shutdown(wait=False)
        api_pool.shutdown(wait=False)
        raise
    if http is not None:
        await http.start()
    await server.set_serving(True)
    logger.info("gateway serving %s (max_model_len %d) on port %d%s%s", info.model,
                info.max_model_len, port, f", HTTP on port {http.port}" if http else "",
                ", API key required" if api_key else "")
    return Gateway(server, replicas, admission, metrics_server, pool, api_pool, http)


def server_options(config: GatewayConfig) -> list[tuple[str, Any]]:
    """The shared server options, with requests larger than max_request_bytes refused by gRPC
    (RESOURCE_EXHAUSTED) before they are even parsed, and the public door's connection limits:
    a client that never finishes its handshake, or holds a connection with no call open, is
    closed (gRPC's own defaults: 120 s and never). The port is shared only with reuse_port."""
    limits = config.connections
    replaced = ("grpc.max_receive_message_length", "grpc.server_handshake_timeout_ms",
                "grpc.max_connection_idle_ms", "grpc.so_reuseport")
    options = [o for o in DEFAULT_OPTIONS if o[0] not in replaced]
    return [*options, ("grpc.max_receive_message_length", config.limits.max_request_bytes),
            ("grpc.so_reuseport", int(config.reuse_port)),
            ("grpc.server_handshake_timeout_ms", round(limits.grpc_handshake_timeout_s * 1000)),
            ("grpc.max_connection_idle_ms", round(limits.grpc_max_connection_idle_s * 1000))]


async def serve(config: GatewayConfig) -> None:
    """Run until SIGTERM/SIGINT: NOT_SERVING, refuse new requests, let live ones finish."""
    gateway = await start_gateway(config)
    tune_gc_after_startup()
    grace_s = config.shutdown.drain_timeout_s
    try:
        await gateway.server.serve_until_signal(grace_s, drain=lambda: gateway.drain(grace_s))
    finally:
        if gateway.http is not None:
            await gateway.http.stop(grace_s)
        await gateway.close_resources()
