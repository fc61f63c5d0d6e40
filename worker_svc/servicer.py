"""The Worker gRPC service over the worker core: convert in, call, convert out.

Every model call runs on ONE dedicated thread, in order (worker_svc/model_thread.py): the model
and its KV cache are not thread-safe, and the event loop stays free to answer health checks while
a step runs. ExecuteStep hands steps to that thread in previous_step_id order, whichever RPC
arrived first (LaunchWindow.may_submit). The model is
loaded at startup from the worker's own flags, so the scheduler's LoadModel is instant unless it
asks for something else.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc
from pagedserve.services.common.config import (
    EngineConfig,
    TlsConfig,
    WorkerServiceConfig,
)
from pagedserve.services.common.errors import (
    InvalidRequest,
    StepOutOfOrder,
    Unavailable,
)
from pagedserve.services.common.gc_tuning import tune_gc_after_load
from pagedserve.services.common.step_plan import StepOutput, StepPlan, WorkerInfo
from pagedserve.services.rpc.convert_worker import (
    memory_profile_to_proto,
    prepare_grammars_from_proto,
    step_output_to_proto,
    step_plan_from_proto,
    worker_info_to_proto,
)
from pagedserve.services.rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from pagedserve.services.rpc.metrics import MetricsServer, start_metrics_server
from pagedserve.services.rpc.roles import WORKER_CALLERS, RoleInterceptor
from pagedserve.services.rpc.server import ServiceBinding, ServiceServer, create_server
from pagedserve.services.rpc.status import map_errors
from pagedserve.services.rpc.tls import internal_server_credentials
from pagedserve.worker_svc.kv_transfer import GrpcKvTransport, KvTransport, read_block_messages
from pagedserve.worker_svc.metrics import WorkerMetrics
from pagedserve.worker_svc.model_thread import ModelThread
from pagedserve.worker_svc.parallel import leave_tensor_parallel
from pagedserve.worker_svc.worker import Worker, create_worker
from prometheus_client import CollectorRegistry

logger = logging.getLogger(__name__)

T = TypeVar("T")
STEP_ORDER_WAIT_S = 60.0  # how long a step waits for its predecessor's RPC to arrive
KV_PULL_TIMEOUT_S = 60.0  # a PullKvBlocks call without a deadline


def merge_load_request(config: EngineConfig, msg: worker_pb2.LoadModelRequest) -> EngineConfig:
    """Empty and zero fields keep the worker's flags."""
    model = config.model
    overrides: dict[str, Any] = {name: getattr(msg, name)
                                 for name in ("model", "dtype", "max_model_len", "load_format",
                                              "seed") if getattr(msg, name)}
    parallel = config.parallel
    if msg.tensor_parallel_size:
        parallel = dataclasses.replace(parallel, tensor_parallel_size=msg.tensor_parallel_size)
    return dataclasses.replace(config, model=dataclasses.replace(model, **overrides),
                               parallel=parallel)


def _check_matches(field: str, requested: float, own: float) -> None:
    """A budget the scheduler sized itself by must be the one the worker uses (0 = don't care)."""
    if requested and requested != own:
        raise InvalidRequest(f"{field}={requested} differs from the worker's own {field}={own}; "
                             f"start the scheduler and the worker with the same value")


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self, config: EngineConfig, rank: int = 0,
                 on_ready: Callable[[bool], Awaitable[None]] | None = None,
                 tls: TlsConfig | None = None) -> None:
        """`tls`: this worker's own certificate, what it pulls KV blocks from other workers
        with."""
        self.config = config
        self.rank = rank
        self.on_ready = on_ready
        self._model_thread = ModelThread("worker-model")
        self._worker: Worker | None = None
        self._load_lock = asyncio.Lock()  # LoadModel during the startup load waits for it
        self._step_order = asyncio.Condition()
        self.metrics: WorkerMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        self.kv_transport: KvTransport = GrpcKvTransport(
            lambda: self._loaded().bytes_per_kv_block,
            lambda block_ids, data: self._run(self._loaded().write_kv_blocks, block_ids, data),
            tls)

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(self._model_thread.submit(fn, *args))

    async def _set_ready(self, is_ready: bool) -> None:
        if self.on_ready is not None:
            await self.on_ready(is_ready)

    @property
    def worker(self) -> Worker | None:
        return self._worker

    def _loaded(self) -> Worker:
        if self._worker is None:
            raise Unavailable("the worker has no model loaded yet (LoadModel)")
        return self._worker

    async def load(self, config: EngineConfig | None = None) -> WorkerInfo:
        async with self._load_lock:
            return await self._load(config or self.config)

    async def _load(self, config: EngineConfig) -> WorkerInfo:
        await self._set_ready(False)
        self._worker = None

        def load() -> tuple[Worker, WorkerInfo]:
            worker = create_worker(config, self.rank)
            return worker, worker.load_model()

        worker, info = await self._run(load)
        grammars = worker.runner.grammars if worker.runner is not None else None
        if self.metrics is not None and grammars is not None:
            grammars.cache.on_compiled = self.metrics.grammar_compile_time.observe
        self._worker = worker
        tune_gc_after_load()  # the full collections of a process holding a model stall steps
        return info

    def close(self) -> None:
        if self.metrics_server is not None:
            self.metrics_server.stop()
        self._model_thread.shutdown()
        leave_tensor_parallel()

    @map_errors
    async def GetInfo(self, request: worker_pb2.GetInfoRequest,
                      context: grpc.aio.ServicerContext) -> worker_pb2.GetInfoResponse:
        return worker_pb2.GetInfoResponse(info=worker_info_to_proto(self._loaded().get_info()))

    @map_errors
    async def LoadModel(self, request: worker_pb2.LoadModelRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.LoadModelResponse:
        config = merge_load_request(self.config, request)
        async with self._load_lock:
            worker = self._worker
            is_kept = (worker is not None and worker.config.model == config.model
                       and worker.config.parallel == config.parallel)
            if is_kept:
                info = worker.get_info()
                logger.info("LoadModel: %s is loaded already; kept it", config.model.model)
            else:
                info = await self._load(config)
        return worker_pb2.LoadModelResponse(info=worker_info_to_proto(info),
                                            kept_loaded_model=is_kept)

    @map_errors
    async def ProfileMemory(self, request: worker_pb2.ProfileMemoryRequest,
                            context: grpc.aio.ServicerContext
                            ) -> worker_pb2.ProfileMemoryResponse:
        worker = self._loaded()
        cache, scheduler = worker.config.cache, worker.config.scheduler
        _check_matches("block_size", request.block_size, cache.block_size)
        _check_matches("gpu_memory_utilization", request.gpu_memory_utilization,
                       cache.gpu_memory_utilization)
        _check_matches("kv_cache_memory_gib", request.kv_cache_memory_gib,
                       cache.kv_cache_memory_gib)
        _check_matches("swap_space_gib", request.swap_space_gib, cache.swap_space_gib)
        _check_matches("max_num_batched_tokens", request.max_num_batched_tokens,
                       scheduler.max_num_batched_tokens)
        _check_matches("max_num_seqs", request.max_num_seqs, scheduler.max_num_seqs)
        return memory_profile_to_proto(await self._run(worker.profile_memory))

    @map_errors
    async def InitCache(self, request: worker_pb2.InitCacheRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.InitCacheResponse:
        worker = self._loaded()
        _check_matches("block_size", request.block_size, worker.config.cache.block_size)
        await self._set_ready(False)
        is_kept = await self._run(worker.init_cache, request.num_gpu_blocks,
                                  request.num_cpu_blocks, request.scheduler_epoch)
        await self._set_ready(True)
        logger.info("KV cache: %d device and %d CPU blocks, %s (scheduler epoch %d)",
                    request.num_gpu_blocks, request.num_cpu_blocks,
                    "kept" if is_kept else "allocated", request.scheduler_epoch)
        return worker_pb2.InitCacheResponse(kept_cache=is_kept)

    @map_errors
    async def WarmUp(self, request: worker_pb2.WarmUpRequest,
                     context: grpc.aio.ServicerContext) -> worker_pb2.WarmUpResponse:
        num_graphs = await self._run(self._loaded().warm_up, list(request.batch_sizes))
        return worker_pb2.WarmUpResponse(num_graphs_captured=num_graphs)

    @map_errors
    async def ExecuteStep(self, request: worker_pb2.ExecuteStepRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.ExecuteStepResponse:
        worker = self._loaded()
        plan = step_plan_from_proto(request)
        # refused at once, not after waiting for its predecessor (nor counted as submitted); the
        # model thread checks again, after any InitCache queued before the step
        worker.check_step(plan)
        async with self._step_order:
            try:
                if not worker.steps.may_submit(plan):  # else no timer and task for the wait
                    await asyncio.wait_for(self._step_order.wait_for(
                        lambda: worker.steps.may_submit(plan)), STEP_ORDER_WAIT_S)
            except TimeoutError:
                raise StepOutOfOrder(
                    f"step {plan.step_id} waited {STEP_ORDER_WAIT_S:.0f} s for step "
                    f"{plan.previous_step_id}, which never came") from None
            running = self._model_thread.submit_step(  # queued on the model thread now
                worker, plan, then=lambda output: self._respond(plan, output))
            worker.steps.submitted_step_id = plan.step_id
            self._step_order.notify_all()
        return await asyncio.wrap_future(running)

    def _respond(self, plan: StepPlan, output: StepOutput) -> worker_pb2.ExecuteStepResponse:
        """On the model thread, the response included: the event loop only hands it to gRPC,
        so the next step, queued behind this one, never waits for the loop's Python."""
        if self.metrics is not None:
            self.metrics.record_step(plan, output.timings)
        return step_output_to_proto(output)

    @map_errors
    async def ClearState(self, request: worker_pb2.ClearStateRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.ClearStateResponse:
        worker = self._loaded()

        def clear() -> int:
            num_seqs = len(worker.runner.mirrors) if worker.runner is not None else 0
            worker.clear_state(request.scheduler_epoch)
            return num_seqs

        num_cleared_seqs = await self._run(clear)
        return worker_pb2.ClearStateResponse(num_cleared_seqs=num_cleared_seqs)

    @map_errors
    async def PrepareGrammars(self, request: worker_pb2.PrepareGrammarsRequest,
                              context: grpc.aio.ServicerContext
                              ) -> worker_pb2.PrepareGrammarsResponse:
        constraints = prepare_grammars_from_proto(request)
        await asyncio.wrap_future(self._loaded().prepare_grammars(constraints))
        return worker_pb2.PrepareGrammarsResponse()

    @map_errors
    async def PullKvBlocks(self, request: worker_pb2.PullKvBlocksRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.PullKvBlocksResponse:
        self._loaded().check_epoch(request.scheduler_epoch, "PullKvBlocks")
        remaining_s = context.time_remaining()
        num_bytes = await self.kv_transport.pull(
            request.source_address, list(request.src_block_ids), list(request.dst_block_ids),
            remaining_s if remaining_s is not None else KV_PULL_TIMEOUT_S)
        return worker_pb2.PullKvBlocksResponse(num_bytes=num_bytes)

    @map_errors
    async def ReadKvBlocks(self, request: worker_pb2.ReadKvBlocksRequest,
                           context: grpc.aio.ServicerContext
                           ) -> AsyncIterator[worker_pb2.ReadKvBlocksResponse]:
        worker = self._loaded()
        async for msg in read_block_messages(
                list(request.block_ids), worker.bytes_per_kv_block,
                lambda block_ids: self._run(worker.read_kv_blocks, block_ids)):
            yield msg


def create_worker_server(config: EngineConfig, service: WorkerServiceConfig
                         ) -> tuple[ServiceServer, WorkerServicer]:
    servicer = WorkerServicer(config, service.rank, tls=service.tls)
    server, _ = create_server(
        [ServiceBinding(servicer, worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                        "pagedserve.internal.v1.WorkerService")], service.host, service.port,
        credentials=internal_server_credentials(service.tls, service.host, "worker"),
        health_port=service.tls.health_port,
        interceptors=[RoleInterceptor(WORKER_CALLERS)] if service.tls.is_enabled else ())
    servicer.on_ready = server.set_serving
    return server, servicer


async def start_worker(config: EngineConfig, service: WorkerServiceConfig
                       ) -> tuple[ServiceServer, WorkerServicer]:
    """Health turns SERVING once a scheduler's handshake has allocated the cache."""
    server, servicer = create_worker_server(config, service)
    await server.start()
    logger.info("worker rank %d listening on %s:%d", service.rank, service.host, server.port)
    try:
        registry = CollectorRegistry()
        servicer.metrics = WorkerMetrics(registry, config.model.name,
                                         service.rank)
        servicer.metrics_server = start_metrics_server(
            registry, service.host, service.metrics, "worker")
        await servicer.load()
    except BaseException:
        await server.shutdown(0)  # its health-only port too
        servicer.close()
        raise
    return server, servicer


async def serve(config: EngineConfig, service: WorkerServiceConfig) -> None:
    server, servicer = await start_worker(config, service)
    try:
        await server.serve_until_signal(service.shutdown.drain_timeout_s)
    finally:
        await server.shutdown(0)
        servicer.close()
