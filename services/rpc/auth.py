"""The API key on the gRPC front door: a server interceptor that answers UNAUTHENTICATED to a call
of a guarded service without metadata `authorization: Bearer KEY` (or the admin token), from the
metadata alone: the request is never parsed, and the handler never runs. Health and reflection
are not guarded."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

import grpc
from grpc_status import rpc_status
from pagedserve.services.common.api_key import is_authorized
from pagedserve.services.common.errors import Reason
from pagedserve.services.rpc.status import status_with_reason

_MESSAGE = "a valid API key is required: metadata 'authorization: Bearer <key>'"


async def _refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
    await context.abort_with_status(rpc_status.to_status(status_with_reason(
        grpc.StatusCode.UNAUTHENTICATED, _MESSAGE, Reason.UNAUTHENTICATED)))


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str, guarded_services: Collection[str], admin_token: str = ""
                 ) -> None:
        self._api_key = api_key
        self._admin_token = admin_token
        self._prefixes = tuple(f"/{name}/" for name in guarded_services)

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefixes):
            return handler
        metadata = dict(handler_call_details.invocation_metadata or ())
        authorization = metadata.get("authorization")
        if isinstance(authorization, bytes):
            authorization = authorization.decode(errors="replace")
        if is_authorized(self._api_key, authorization, self._admin_token):
            return handler
        kw = {"response_serializer": handler.response_serializer}  # the request stays bytes
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_refuse, **kw)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_refuse, **kw)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_refuse, **kw)
        return grpc.unary_unary_rpc_method_handler(_refuse, **kw)
