"""Requests that are not valid protobuf (garbage or truncated bytes, bad UTF-8 in a string field)
fail with INVALID_ARGUMENT and a message, like any other bad request.

gRPC deserializes a request before the handler runs; left alone, a message that does not parse
ends the call with an opaque status and a logged traceback per call. This interceptor (every
server of create_server has it) swaps each handler's deserializer for one that turns a parse
error into a MalformedRequest value, and the handler for one that answers that value with
INVALID_ARGUMENT. Requests that parse reach the handler unchanged.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.rpc.status import abort_with


@dataclass(frozen=True, slots=True)
class MalformedRequest:
    reason: str


def _safe(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except (DecodeError, UnicodeDecodeError) as exc:
            return MalformedRequest(f"{type(exc).__name__}: {exc}")

    return deserialize


async def _refuse(request: MalformedRequest, context: grpc.aio.ServicerContext) -> None:
    """No field to name: the bytes did not parse into fields."""
    await abort_with(context, InvalidRequest(
        f"the request is not a valid protobuf message of this method's request type "
        f"({request.reason})", reason=Reason.MALFORMED_REQUEST))


def _guard(behavior: Callable[..., Any]) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def streaming(request: Any, context: grpc.aio.ServicerContext
                            ) -> AsyncIterator[Any]:
            if isinstance(request, MalformedRequest):
                await _refuse(request, context)
            async for response in behavior(request, context):
                yield response

        return streaming

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await _refuse(request, context)
        return await behavior(request, context)

    return unary


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    """Guards unary-request methods (all of pagedserve's); client-streaming ones pass as they
    are."""

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        kw = {"request_deserializer": _safe(handler.request_deserializer),
              "response_serializer": handler.response_serializer}
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(_guard(handler.unary_unary), **kw)
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_guard(handler.unary_stream), **kw)
        return handler
