"""The Scheduler gRPC service: convert in, call the AsyncEngine, convert out. It listens at
once, NOT_SERVING until the worker handshake is done.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc
from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.scheduler_svc.engine_core import EngineCore
from pagedserve.scheduler_svc.kv_event_stream import watch_kv_events
from pagedserve.scheduler_svc.kv_transfer import KvTransfers
from pagedserve.scheduler_svc.metrics import (
    KvTransferMetrics,
    SchedulerMetrics,
    SpecDecodeCollector,
    cache_config_info,
)
from pagedserve.scheduler_svc.stats import StatLogger
from pagedserve.scheduler_svc.submit_stream import serve_submit_stream
from pagedserve.scheduler_svc.worker_client import WorkerClient
from pagedserve.services.common.config import (
    EngineConfig,
    SchedulerServiceConfig,
    served_model_name,
)
from pagedserve.services.common.engine_api import ROLE_BOTH
from pagedserve.services.common.errors import ConfigError, InvalidRequest, Reason, Unavailable
from pagedserve.services.common.gc_tuning import tune_gc_after_startup
from pagedserve.services.rpc.convert_kv_events import (
    kv_event_batch_to_proto,
    watch_kv_events_request_from_proto,
)
from pagedserve.services.rpc.convert_scheduler import (
    abort_request_from_proto,
    kv_transfer_params_to_proto,
    load_to_proto,
    pause_request_from_proto,
    served_model_to_proto,
    watch_load_request_from_proto,
)
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.metrics import MetricsServer, start_metrics_server
from pagedserve.services.rpc.roles import SCHEDULER_CALLERS, RoleInterceptor
from pagedserve.services.rpc.server import ServiceBinding, ServiceServer, create_server
from pagedserve.services.rpc.status import map_errors
from pagedserve.services.rpc.tls import internal_server_credentials
from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, model: str, engine: AsyncEngine | None = None,
                 name: str = "", role: str = ROLE_BOTH) -> None:
        """`engine` is set once the worker handshake is done; until then calls are UNAVAILABLE.
        `name`: --served-model-name (empty = the folder's name). `role`: --role."""
        self.model = model
        self.name = name
        self.role = role
        self.engine = engine
        self.kv_transfers: KvTransfers | None = None  # set with the engine
        self.metrics_server: MetricsServer | None = None

    def _engine(self) -> AsyncEngine:
        if self.engine is None:
            raise Unavailable("the scheduler is starting (worker handshake in progress)",
                              reason=Reason.SCHEDULER_STARTING)
        return self.engine

    @map_errors
    async def SubmitStream(self, requests: AsyncIterator[scheduler_pb2.SubmitStreamRequest],
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[scheduler_pb2.SubmitStreamResponse]:
        engine = self._engine()
        async for response in serve_submit_stream(engine, self.name or served_model_name(self.model),
                                                  requests, self.kv_transfers):
            yield response

    @map_errors
    async def Abort(self, request: scheduler_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.AbortResponse:
        await self._engine().abort(abort_request_from_proto(request))
        return scheduler_pb2.AbortResponse()

    @map_errors
    async def Pause(self, request: scheduler_pb2.PauseRequest,
                    context: grpc.aio.ServicerContext) -> scheduler_pb2.PauseResponse:
        await self._engine().set_paused(pause_request_from_proto(request))
        return scheduler_pb2.PauseResponse()

    @map_errors
    async def Resume(self, request: scheduler_pb2.ResumeRequest,
                     context: grpc.aio.ServicerContext) -> scheduler_pb2.ResumeResponse:
        await self._engine().set_paused(pause_request_from_proto(request))
        return scheduler_pb2.ResumeResponse()

    @map_errors
    async def GetLoad(self, request: scheduler_pb2.GetLoadRequest,
                      context: grpc.aio.ServicerContext) -> scheduler_pb2.GetLoadResponse:
        return load_to_proto(self._engine().get_load(), scheduler_pb2.GetLoadResponse)

    @map_errors
    async def WatchLoad(self, request: scheduler_pb2.WatchLoadRequest,
                        context: grpc.aio.ServicerContext
                        ) -> AsyncIterator[scheduler_pb2.WatchLoadResponse]:
        async for load in self._engine().watch_load(watch_load_request_from_proto(request)):
            yield load_to_proto(load, scheduler_pb2.WatchLoadResponse)

    @map_errors
    async def WatchKvEvents(self, request: scheduler_pb2.WatchKvEventsRequest,
                            context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[scheduler_pb2.WatchKvEventsResponse]:
        engine = self._engine()
        async for batch in watch_kv_events(engine.core.block_manager.kv_events,
                                           watch_kv_events_request_from_proto(request),
                                           engine.wait_for_step):
            yield kv_event_batch_to_proto(batch)

    @map_errors
    async def GetServedModel(self, request: scheduler_pb2.GetServedModelRequest,
                             context: grpc.aio.ServicerContext
                             ) -> scheduler_pb2.GetServedModelResponse:
        core = self._engine().core
        return served_model_to_proto(self.model, core.worker_info, core.max_model_len,
                                     core.vocab_size, core.eos_token_ids,
                                     block_size=core.block_manager.block_size,
                                     num_gpu_blocks=core.num_gpu_blocks,
                                     max_num_seqs=core.config.scheduler.max_num_seqs,
                                     served_model_name=self.name, role=self.role)

    @map_errors
    async def ExportKvBlocks(self, request: scheduler_pb2.ExportKvBlocksRequest,
                             context: grpc.aio.ServicerContext
                             ) -> scheduler_pb2.ExportKvBlocksResponse:
        self._engine()
        assert self.kv_transfers is not None
        if request.lease_ttl_s < 0:
            raise InvalidRequest(f"lease_ttl_s must be >= 0, got {request.lease_ttl_s}",
                                 field="lease_ttl_s")
        lease_id, params = await self.kv_transfers.export(list(request.prompt_token_ids),
                                                          request.lease_ttl_s)
        return scheduler_pb2.ExportKvBlocksResponse(
            lease_id=lease_id, kv_transfer=kv_transfer_params_to_proto(params))

    @map_errors
    async def ReleaseKvBlocks(self, request: scheduler_pb2.ReleaseKvBlocksRequest,
                              context: grpc.aio.ServicerContext
                              ) -> scheduler_pb2.ReleaseKvBlocksResponse:
        self._engine()
        assert self.kv_transfers is not None
        self.kv_transfers.release(request.lease_id)
        return scheduler_pb2.ReleaseKvBlocksResponse()


def create_scheduler_server(config: EngineConfig, service_config: SchedulerServiceConfig
                            ) -> tuple[ServiceServer, SchedulerServicer]:
    servicer = SchedulerServicer(config.model.model, name=config.model.served_model_name,
                                 role=service_config.role)
    server, _ = create_server(
        [ServiceBinding(servicer, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                        "pagedserve.internal.v1.SchedulerService")],
        service_config.host, service_config.port,
        credentials=internal_server_credentials(service_config.tls, service_config.host,
                                                "scheduler"),
        health_port=service_config.tls.health_port,
        interceptors=[RoleInterceptor(SCHEDULER_CALLERS)] if service_config.tls.is_enabled else ())
    return server, servicer


async def start_engine(config: EngineConfig, service_config: SchedulerServiceConfig,
                       stat_loggers: list[StatLogger] | None = None) -> AsyncEngine:
    num_ranks = config.parallel.tensor_parallel_size
    if len(service_config.worker_addresses) != num_ranks:
        raise ConfigError(f"worker_addresses has {len(service_config.worker_addresses)} "
                          f"addresses; tensor_parallel_size={num_ranks} needs one per rank")
    workers = [WorkerClient(address, config, service_config.step_timeout_s,
                            service_config.startup_timeout_s, service_config.tls)
               for address in service_config.worker_addresses]
    try:
        return await AsyncEngine.start(lambda: EngineCore(config, workers),
                                       service_config.shutdown.drain_timeout_s, stat_loggers,
                                       service_config.stats_interval_s)
    except BaseException:
        for worker in workers:
            worker.close()
        raise


async def start_scheduler(config: EngineConfig, service_config: SchedulerServiceConfig
                          ) -> tuple[ServiceServer, SchedulerServicer]:
    server, servicer = create_scheduler_server(config, service_config)
    await server.start()
    logger.info("scheduler listening on %s:%d; handshake with workers %s", service_config.host,
                server.port, ", ".join(service_config.worker_addresses))
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, config.model.name,
                               lambda: None if servicer.engine is None else servicer.engine.load)
    if config.scheduler.speculative is not None:
        registry.register(SpecDecodeCollector(config.model.name, lambda: (
            None if servicer.engine is None
            else servicer.engine.core.scheduler.speculator.totals)))
    try:
        servicer.metrics_server = start_metrics_server(
            registry, service_config.host, service_config.metrics, "scheduler")
        if service_config.role != ROLE_BOTH and not config.cache.enable_prefix_caching:
            raise ConfigError(f"role={service_config.role} needs enable_prefix_caching: the "
                              "prefill replica's computed blocks reach the decode replica's "
                              "prefix cache")
        engine = await start_engine(config, service_config, [metrics])
        servicer.kv_transfers = KvTransfers(
            engine, service_config.kv_transfer_addresses or service_config.worker_addresses,
            service_config.kv_transfer_timeout_s)
        servicer.kv_transfers.on_transfer.append(
            KvTransferMetrics(registry, config.model.name).record)
        servicer.engine = engine
        core = servicer.engine.core
        metrics.on_engine_ready(core.max_model_len, cache_config_info(
            config.cache, core.num_gpu_blocks, core.num_cpu_blocks))
    except BaseException:
        await server.shutdown(0)  # its health-only port too
        if servicer.metrics_server is not None:
            servicer.metrics_server.stop()
        raise
    await server.set_serving(True)
    logger.info("scheduler serving on port %d", server.port)
    return server, servicer


async def stop_scheduler(server: ServiceServer, servicer: SchedulerServicer,
                         grace_s: float = 0.0) -> None:
    """Drain (bounded by grace_s), stop; worker channels still in use are left to the exit."""
    engine = servicer.engine
    drain = None if engine is None else (lambda: engine.drain(grace_s))
    await server.shutdown(grace_s, drain)
    if servicer.metrics_server is not None:
        servicer.metrics_server.stop()
    if engine is not None and await engine.stop():
        for worker in engine.core.workers:
            worker.close()


async def serve(config: EngineConfig, service_config: SchedulerServiceConfig) -> None:
    server, servicer = await start_scheduler(config, service_config)
    tune_gc_after_startup()
    engine = servicer.engine
    grace_s = service_config.shutdown.drain_timeout_s
    try:
        await server.serve_until_signal(grace_s, drain=lambda: engine.drain(grace_s))
    finally:
        await stop_scheduler(server, servicer)
