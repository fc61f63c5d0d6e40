"""The gateway's side of scheduler.proto: one channel, every request multiplexed over one
SubmitStream call (a traced one carries its trace context inside), unary calls with deadlines.

A request has no deadline (it lives as long as it generates), so a dead scheduler is found
otherwise: a request opens only on a connected channel, and keepalive pings end a call whose
peer vanished. A handler that leaves `submit` early cancels the request in the scheduler.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.services.common.config import TlsConfig
from pagedserve.services.common.engine_api import (
    AbortRequest,
    EngineLoad,
    KVTransferParams,
    PauseRequest,
    ResumedOutput,
    SubmitRequest,
)
from pagedserve.services.common.errors import PagedServeError, Reason, Unavailable
from pagedserve.services.common.kv_events import KVEventBatch, WatchKVEventsRequest
from pagedserve.services.common.outputs import RequestOutput
from pagedserve.services.gateway.submit_stream import SubmitStreamClient
from pagedserve.services.gateway.validation import PreparedRequest
from pagedserve.services.rpc.convert_kv_events import (
    kv_event_batch_from_proto,
    watch_kv_events_request_to_proto,
)
from pagedserve.services.rpc.convert_scheduler import (
    abort_request_to_proto,
    kv_transfer_params_from_proto,
    load_from_proto,
    pause_request_to_proto,
    submit_request_to_proto,
    token_event_from_proto,
    watch_load_request_to_proto,
)
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.request_span import RequestSpan
from pagedserve.services.rpc.status import error_from_rpc, status_of
from pagedserve.services.rpc.tls import internal_aio_channel
from pagedserve.services.rpc.tracing import aio_client_interceptors

T = TypeVar("T")
# a request's outputs, as they come; True leaves the request
OutputHandler = Callable[[RequestOutput], bool]

PEER = "scheduler"
MAX_RECONNECT_BACKOFF_MS = 2_000  # a restarted scheduler is used again within this
# what a client is told to wait when no scheduler serves its request: a restart is seen by then
SCHEDULER_RETRY_AFTER_S = MAX_RECONNECT_BACKOFF_MS / 1000
CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)
_FAILED_STATES = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def _request_field(path: str) -> str:
    """A SubmitRequest field path as the client's request names it: the prompt's ids are its
    token_ids (a text prompt's ids come from the tokenizer and are always valid)."""
    if path == "prompt_token_ids":
        return "prompt"
    if path.startswith("prompt_token_ids["):
        return path.removeprefix("prompt_")
    return path


class SchedulerClient:
    def __init__(self, address: str, rpc_timeout_s: float, tls: TlsConfig | None = None,
                 server_name: str = "") -> None:
        """`server_name`: the name its certificate carries when `address` is one of the IPs a
        name resolved to."""
        self.address = address
        self._rpc_timeout_s = rpc_timeout_s
        options = CHANNEL_OPTIONS
        if server_name:
            options = (*options, ("grpc.ssl_target_name_override", server_name))
        self._channel = internal_aio_channel(address, tls, options,
                                             interceptors=aio_client_interceptors(address))
        self._stub = scheduler_pb2_grpc.SchedulerServiceStub(self._channel)
        self._submit_stream = SubmitStreamClient(self._stub, PEER, SCHEDULER_RETRY_AFTER_S)

    async def close(self) -> None:
        await self._submit_stream.close()
        await self._channel.close()

    async def wait_until_serving(self) -> None:
        """No polling: a Health.Watch stream that waits for the connection."""
        stub = health_pb2_grpc.HealthStub(self._channel)
        call = stub.Watch(health_pb2.HealthCheckRequest(service=""), wait_for_ready=True)
        try:
            async for response in call:
                if response.status == health_pb2.HealthCheckResponse.SERVING:
                    return
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, PEER) from exc
        finally:
            call.cancel()
        raise Unavailable(f"{PEER} at {self.address} ended its health stream before serving",
                          reason=Reason.SCHEDULER_UNAVAILABLE,
                          retry_after_s=SCHEDULER_RETRY_AFTER_S)

    async def get_served_model(self) -> scheduler_pb2.GetServedModelResponse:
        try:
            return await self._stub.GetServedModel(scheduler_pb2.GetServedModelRequest(),
                                                   timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, PEER) from exc

    async def abort(self, request: AbortRequest) -> None:
        """NotFound when the scheduler has no live request with that id of that owner."""
        try:
            await self._stub.Abort(abort_request_to_proto(request), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, PEER) from exc

    async def set_paused(self, request: PauseRequest) -> None:
        """Pause or Resume; NotFound when the request is no longer live there."""
        call = self._stub.Pause if request.is_paused else self._stub.Resume
        try:
            await call(pause_request_to_proto(request), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, PEER) from exc

    def watch_load(self, min_interval_s: float) -> AsyncIterator[EngineLoad]:
        """The scheduler's load, pushed on change, until the stream breaks (Unavailable)."""
        return self._follow(self._stub.WatchLoad(watch_load_request_to_proto(min_interval_s)),
                            load_from_proto, "load stream")

    def watch_kv_events(self, request: WatchKVEventsRequest) -> AsyncIterator[KVEventBatch]:
        """The scheduler's KV events from where `request` resumes, until the stream breaks."""
        return self._follow(self._stub.WatchKvEvents(watch_kv_events_request_to_proto(request)),
                            kv_event_batch_from_proto, "KV event stream")

    async def _follow(self, call, convert: Callable[[Any], T], what: str) -> AsyncIterator[T]:
        """A server stream's messages, converted; its end or break is Unavailable."""
        try:
            async for msg in call:
                yield convert(msg)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, PEER) from exc
        finally:
            call.cancel()
        raise Unavailable(f"{PEER} at {self.address} ended its {what}",
                          reason=Reason.SCHEDULER_UNAVAILABLE,
                          retry_after_s=SCHEDULER_RETRY_AFTER_S)

    async def export_kv_blocks(self, prompt_token_ids: list[int]
                               ) -> tuple[str, KVTransferParams]:
        """Pins the prompt's computed blocks there for a decode replica (lease id, where)."""
        try:
            response = await self._stub.ExportKvBlocks(scheduler_pb2.ExportKvBlocksRequest(
                prompt_token_ids=prompt_token_ids), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, PEER) from exc
        return response.lease_id, kv_transfer_params_from_proto(response.kv_transfer)

    async def release_kv_blocks(self, lease_id: str) -> None:
        try:
            await self._stub.ReleaseKvBlocks(scheduler_pb2.ReleaseKvBlocksRequest(
                lease_id=lease_id), timeout=self._rpc_timeout_s)
        except grpc.aio.AioRpcError as exc:
            raise error_from_rpc(exc, PEER) from exc

    async def submit(self, request: PreparedRequest, on_output: OutputHandler, owner: str = "",
                     resumed_outputs: list[ResumedOutput] | None = None,
                     kv_transfer: KVTransferParams | None = None) -> None:
        """Hands each of the request's outputs to `on_output` (in the SubmitStream call's
        reader, so it must not block; True leaves the request, which cancels it) until it ends.
        `kv_transfer`: the prompt's blocks are pulled from a prefill replica first."""
        await self._ensure_connected()
        msg = submit_request_to_proto(SubmitRequest(
            request_id=request.request_id, prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling, priority=request.priority, owner=owner,
            resumed_outputs=resumed_outputs or [], is_pooling=request.is_pooling,
            kv_transfer=kv_transfer))
        request_id = request.request_id
        wants_prompt_logprobs = request.sampling.prompt_logprobs is not None
        span = RequestSpan.client(msg, self.address)

        def on_response(response: scheduler_pb2.SubmitResponse) -> bool:
            nonlocal wants_prompt_logprobs
            if span is not None:
                span.on_response(response)
            output = token_event_from_proto(response, request_id, wants_prompt_logprobs)
            wants_prompt_logprobs = False
            return on_output(output)

        code, details = grpc.StatusCode.CANCELLED, None  # unless it ends
        try:
            if not await self._submit_stream.stream(msg, on_response):
                code = grpc.StatusCode.OK
        except PagedServeError as exc:
            code, details = status_of(exc)
            raise exc.with_fields(_request_field) from None
        finally:
            if span is not None:
                span.end(code, details)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """Output `index` of a live request ends in the scheduler (its stop string matched):
        scheduled no more, its blocks freed."""
        self._submit_stream.finish_sequence(request_id, index)

    async def _ensure_connected(self) -> None:
        """UNAVAILABLE at once when the last connection attempt failed (reconnects back off at
        most MAX_RECONNECT_BACKOFF_MS), else after rpc_timeout_s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._rpc_timeout_s
        state = self._channel.get_state(try_to_connect=True)
        while state != grpc.ChannelConnectivity.READY:
            remaining = deadline - loop.time()
            if state in _FAILED_STATES or remaining <= 0:
                raise Unavailable(f"{PEER} at {self.address} is unreachable ({state.name})",
                                  reason=Reason.SCHEDULER_UNAVAILABLE,
                                  retry_after_s=SCHEDULER_RETRY_AFTER_S)
            try:
                await asyncio.wait_for(self._channel.wait_for_state_change(state), remaining)
            except TimeoutError:
                continue
            state = self._channel.get_state(try_to_connect=True)
