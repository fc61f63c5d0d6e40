"""The public API: Generation and Models servicers (grpc.aio). Thin: convert in, validate,
submit to the scheduler, turn token events into text deltas, convert out.

The gateway keeps nothing that must survive it: the count of its live requests (for admission
and draining) is all. Leaving a stream early — a stop string ends every output, the client
cancels, its deadline passes — cancels the Submit call, which aborts the request in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterator

import grpc
from pagedserve.services.common.errors import (
    InvalidRequest,
    Overloaded,
    PagedServeError,
    Unavailable,
)
from pagedserve.services.gateway.convert import (
    generate_request_from_proto,
    generate_response_to_proto,
    model_info_to_proto,
    stream_delta_to_proto,
    tokenize_request_from_proto,
    tokenize_response_to_proto,
)
from pagedserve.services.gateway.scheduler_client import SchedulerClient
from pagedserve.services.gateway.validation import (
    ModelInfo,
    PreparedRequest,
    prepare_request,
    prompt_token_ids,
)
from pagedserve.services.rpc.status import map_errors
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pagedserve.services.text.text_stream import StreamDelta, TextStream
from pagedserve.services.text.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class Admission:
    """Live requests of this gateway: refuses over the limit (RESOURCE_EXHAUSTED) and while
    draining (UNAVAILABLE); `wait_idle` is what a drain waits on."""

    def __init__(self, max_concurrent_requests: int) -> None:
        self._max_live = max_concurrent_requests
        self._num_live = 0
        self._is_draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self._is_draining:
            raise Unavailable("the gateway is shutting down; retry on another replica")
        if self._num_live >= self._max_live:
            raise Overloaded(f"{self._num_live} requests in flight, the limit "
                             f"(max_concurrent_requests) is {self._max_live}")
        self._num_live += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_live -= 1
            if self._num_live == 0:
                self._idle.set()

    def start_draining(self) -> None:
        self._is_draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()


class GenerationServicer(gateway_pb2_grpc.GenerationServicer):
    def __init__(self, tokenizer: Tokenizer, scheduler: SchedulerClient, model_info: ModelInfo,
                 admission: Admission) -> None:
        self._tokenizer = tokenizer
        self._scheduler = scheduler
        self._info = model_info
        self._admission = admission

    @map_errors
    async def GenerateStream(self, request: gateway_pb2.GenerateRequest,
                             context: grpc.aio.ServicerContext
                             ) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        with self._admission.admit():
            prepared = self._prepare(request)
            async for delta in self._generate(prepared):
                yield stream_delta_to_proto(delta, prepared.request_id)

    @map_errors
    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        with self._admission.admit():
            prepared = self._prepare(request)
            deltas = [delta async for delta in self._generate(prepared)]
        return generate_response_to_proto(prepared.request_id, deltas, prepared.sampling.n)

    @map_errors
    async def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        token_ids = prompt_token_ids(tokenize_request_from_proto(request), self._tokenizer,
                                     self._info)
        return tokenize_response_to_proto(token_ids, self._info.max_model_len)

    @map_errors
    async def Abort(self, request: common_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> common_pb2.AbortResponse:
        """Forwarded to the scheduler, so any gateway replica can abort any request; the
        request's own stream then ends with finish_reason ABORT."""
        if not request.request_id:
            raise InvalidRequest("request_id must not be empty, got ''")
        await self._scheduler.abort(request.request_id)
        return common_pb2.AbortResponse()

    def _prepare(self, request: gateway_pb2.GenerateRequest) -> PreparedRequest:
        return prepare_request(generate_request_from_proto(request), self._tokenizer, self._info)

    async def _generate(self, request: PreparedRequest) -> AsyncIterator[StreamDelta]:
        text_stream = TextStream(request.prompt_token_ids, request.sampling, self._tokenizer)
        outputs = self._scheduler.submit(request)
        errors: list[str] = []
        try:
            async for output in outputs:
                for delta in text_stream.on_output(output):
                    if delta.error:
                        errors.append(f"output {delta.index}: {delta.error}")
                    yield delta
                if text_stream.is_finished:
                    break  # a stop string ended the last output: closing aborts the rest
        finally:
            await outputs.aclose()
        if not text_stream.is_finished:
            raise Unavailable(f"the scheduler ended request {request.request_id!r} before "
                              "every output finished")
        if errors:
            raise PagedServeError(f"request {request.request_id!r} failed: {'; '.join(errors)}")


class ModelsServicer(gateway_pb2_grpc.ModelsServicer):
    def __init__(self, model_info: ModelInfo) -> None:
        self._info = model_info

    @map_errors
    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> gateway_pb2.ModelInfo:
        return model_info_to_proto(self._info)
