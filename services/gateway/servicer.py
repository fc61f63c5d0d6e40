"""The public gRPC API: Generation and Models servicers (grpc.aio). Thin: convert in, call the
gateway's Frontend, convert out."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time

import grpc
from pagedserve.services.common.errors import PagedServeError
from pagedserve.services.gateway.convert import (
    embed_request_from_proto,
    generate_request_from_proto,
    generate_response_to_proto,
    proto_field_path,
    served_model_to_info_proto,
    text_delta_to_proto,
    tokenize_request_from_proto,
    tokenize_response_to_proto,
)
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.limits import check_list_lengths
from pagedserve.services.gateway.ownership import grpc_caller
from pagedserve.services.gateway.validation import GenerateInput, ServedModel
from pagedserve.services.rpc.status import grpc_status_of, map_errors
from pagedserve.services.rpc.tracing import set_request_model
from pagedserve.services.rpc.v1 import gateway_pb2, gateway_pb2_grpc


async def _end_stalled_call(context: grpc.aio.ServicerContext, error: PagedServeError) -> None:
    """Queue the call's status behind the output its client has not read, so a client that
    reads again learns why; the Frontend then cancels the handler, which frees the call at once
    instead of waiting for the client."""
    ending = asyncio.ensure_future(context.abort_with_status(
        grpc_status_of(error.with_fields(proto_field_path))))
    ending.add_done_callback(_ignore_abort_error)
    await asyncio.sleep(0)  # let the abort hand its status to gRPC before the handler is cancelled


def _ignore_abort_error(ending: asyncio.Future[None]) -> None:
    if not ending.cancelled():
        ending.exception()  # grpc.aio's abort always raises; the call has ended either way


class GenerationServicer(gateway_pb2_grpc.GenerationServiceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self._frontend = frontend

    def _track(self, method: str) -> contextlib.AbstractContextManager[None]:
        metrics = self._frontend.metrics
        return contextlib.nullcontext() if metrics is None else metrics.track(method)

    def _generate_input(self, request: gateway_pb2.GenerateRequest
                        | gateway_pb2.GenerateStreamRequest) -> GenerateInput:
        """Its lists bounded before the sampling parameters scan them."""
        check_list_lengths(request.sampling.stop, request.sampling.stop_token_ids,
                           self._frontend.limits)
        return generate_request_from_proto(request)

    @map_errors(field_path=proto_field_path)
    async def GenerateStream(self, request: gateway_pb2.GenerateStreamRequest,
                             context: grpc.aio.ServicerContext) -> None:
        """Writes its responses (context.write) rather than yielding them: no generator of this
        handler and of each wrapper around it is resumed per streamed message."""
        arrival_s = time.monotonic()
        set_request_model(self._frontend.info.model)
        with self._track("GenerateStream"):
            generate = self._generate_input(request)
            with self._frontend.admit([generate]):
                prepared = await self._frontend.prepare(generate, arrival_s)
                on_stalled = functools.partial(_end_stalled_call, context)
                request_id, write = prepared.request_id, context.write
                async with contextlib.aclosing(self._frontend.generate(
                        prepared, on_stalled, grpc_caller(context))) as deltas:
                    async for delta in deltas:
                        await write(text_delta_to_proto(delta, request_id))

    @map_errors(field_path=proto_field_path)
    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        arrival_s = time.monotonic()
        set_request_model(self._frontend.info.model)
        with self._track("Generate"):
            generate = self._generate_input(request)
            with self._frontend.admit([generate]):
                prepared = await self._frontend.prepare(generate, arrival_s)
                deltas = [delta async for delta in self._frontend.generate(
                    prepared, caller=grpc_caller(context))]
        return generate_response_to_proto(prepared.request_id, deltas, prepared.sampling.n)

    @map_errors(field_path=proto_field_path)
    async def Embed(self, request: gateway_pb2.EmbedRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        arrival_s = time.monotonic()
        set_request_model(self._frontend.info.model)
        with self._track("Embed"):
            embed = embed_request_from_proto(request)
            with self._frontend.admit([embed]):
                prepared = await self._frontend.prepare(embed, arrival_s)
                embedding = await self._frontend.embed(prepared, grpc_caller(context))
        return gateway_pb2.EmbedResponse(request_id=prepared.request_id, embedding=embedding,
                                         num_prompt_tokens=len(prepared.prompt_token_ids))

    @map_errors(field_path=proto_field_path)
    async def Tokenize(self, request: gateway_pb2.TokenizeRequest,
                       context: grpc.aio.ServicerContext) -> gateway_pb2.TokenizeResponse:
        token_ids = await self._frontend.tokenize(tokenize_request_from_proto(request))
        return tokenize_response_to_proto(token_ids, self._frontend.info.max_model_len)

    @map_errors(field_path=proto_field_path)
    async def Abort(self, request: gateway_pb2.AbortRequest,
                    context: grpc.aio.ServicerContext) -> gateway_pb2.AbortResponse:
        await self._frontend.abort(request.request_id, grpc_caller(context))
        return gateway_pb2.AbortResponse()


class ModelServicer(gateway_pb2_grpc.ModelServiceServicer):
    def __init__(self, model_info: ServedModel) -> None:
        self._info = model_info

    @map_errors(field_path=proto_field_path)
    async def GetModelInfo(self, request: gateway_pb2.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> gateway_pb2.GetModelInfoResponse:
        return served_model_to_info_proto(self._info)
