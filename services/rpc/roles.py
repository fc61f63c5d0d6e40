"""Roles on the internal ports: every internal certificate names its holder's role in a URI SAN,
`spiffe://pagedserve/<role>`, and an internal server runs a method only for the roles that call
it. A refusal is PERMISSION_DENIED naming the role and the method, before the request is parsed.

Only the internal services are guarded; Health and reflection answer any peer the CA signed
(the supervisor watches Health with a certificate of its own role).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncIterator, Callable, Collection, Mapping
from typing import Any

import grpc
from cryptography import x509
from grpc_status import rpc_status
from pagedserve.services.common.errors import Reason
from pagedserve.services.rpc.status import status_with_reason

ROLE_URI_PREFIX = "spiffe://pagedserve/"
GATEWAY = "gateway"
SCHEDULER = "scheduler"
WORKER = "worker"
SUPERVISOR = "supervisor"  # `pagedserve serve` watching its children's Health
ROLES = (GATEWAY, SCHEDULER, WORKER, SUPERVISOR)

# a method's own entry overrides its service's: workers read each other's KV blocks
WORKER_CALLERS = {"pagedserve.internal.v1.WorkerService": (SCHEDULER,),
                  "pagedserve.internal.v1.WorkerService/ReadKvBlocks": (WORKER,)}
SCHEDULER_CALLERS = {"pagedserve.internal.v1.SchedulerService": (GATEWAY,)}


def role_uri(role: str) -> str:
    return ROLE_URI_PREFIX + role


@functools.lru_cache(maxsize=256)
def certificate_roles(pem: bytes) -> tuple[str, ...]:
    """The roles a certificate's URI SANs name, in their order; () for a certificate without."""
    try:
        names = x509.load_pem_x509_certificate(pem).extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    return tuple(uri.removeprefix(ROLE_URI_PREFIX)
                 for uri in names.get_values_for_type(x509.UniformResourceIdentifier)
                 if uri.startswith(ROLE_URI_PREFIX))


def peer_roles(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    pems = context.auth_context().get("x509_pem_cert") or ()
    return certificate_roles(pems[0]) if pems else ()


def refusal(roles: Collection[str], method: str, allowed: Collection[str]) -> str | None:
    """Why peers of `roles` may not call `method`; None when they may."""
    if not roles:
        return (f"{method} refused: the caller's certificate names no pagedserve role. Internal "
                f"certificates carry their role as a URI SAN ({ROLE_URI_PREFIX}<role>, one of "
                f"{', '.join(ROLES)}); one made before roles existed must be issued again "
                f"(pagedserve serve does so at each start, the Helm chart per role)")
    if any(role in allowed for role in roles):
        return None
    return (f"role {' '.join(roles)!r} may not call {method}: only "
            f"{' or '.join(repr(r) for r in allowed)} may")


async def _check(context: grpc.aio.ServicerContext, method: str, allowed: Collection[str]
                 ) -> None:
    message = refusal(peer_roles(context), method, allowed)
    if message is not None:
        await context.abort_with_status(rpc_status.to_status(status_with_reason(
            grpc.StatusCode.PERMISSION_DENIED, message, Reason.PERMISSION_DENIED)))


def _guarded(handler: grpc.RpcMethodHandler, method: str, allowed: Collection[str]
             ) -> grpc.RpcMethodHandler:
    """`handler` behind the role check. A unary request arrives as bytes and is parsed by the
    handler's own deserializer after the check; a stream's messages are read only after it."""
    kw = {"response_serializer": handler.response_serializer}
    if handler.request_streaming:
        behavior = handler.stream_stream or handler.stream_unary
        kw["request_deserializer"] = handler.request_deserializer
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(behavior, method, allowed, lambda request: request), **kw)

        async def unary_response(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            await _check(context, method, allowed)
            return await behavior(requests, context)

        return grpc.stream_unary_rpc_method_handler(unary_response, **kw)
    parse = handler.request_deserializer or (lambda data: data)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(
            _streaming(handler.unary_stream, method, allowed, parse), **kw)

    async def unary(data: bytes, context: grpc.aio.ServicerContext) -> Any:
        await _check(context, method, allowed)
        return await handler.unary_unary(parse(data), context)

    return grpc.unary_unary_rpc_method_handler(unary, **kw)


def _streaming(behavior: Callable[..., Any], method: str, allowed: Collection[str],
               parse: Callable[[Any], Any]) -> Callable[..., AsyncIterator[Any]]:
    async def streaming(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await _check(context, method, allowed)
        if inspect.isasyncgenfunction(behavior):
            async for response in behavior(parse(request), context):
                yield response
        else:  # a coroutine that writes its responses with context.write
            await behavior(parse(request), context)

    return streaming


class RoleInterceptor(grpc.aio.ServerInterceptor):
    """`callers`: service full name (or `service/method`) -> the roles that may call its
    methods (that method)."""

    def __init__(self, callers: Mapping[str, Collection[str]]) -> None:
        self._callers = dict(callers)

    async def intercept_service(self, continuation: Callable[[Any], Any],
                                handler_call_details: grpc.HandlerCallDetails
                                ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        name = method.lstrip("/")
        allowed = self._callers.get(name) or self._callers.get(name.partition("/")[0])
        if handler is None or allowed is None:
            return handler
        return _guarded(handler, method, allowed)
