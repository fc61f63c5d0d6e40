"""ASGI middleware around the whole app: the arrival time, the API key (before routing, so an
unknown route needs the key too) and the request body limit (413)."""

from __future__ import annotations

import time
from collections.abc import Collection
from http import HTTPStatus

from pagedserve.services.common.api_key import is_authorized
from pagedserve.services.common.errors import Reason
from pagedserve.services.gateway.openai.errors import error_response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class ArrivalTime:
    """Stamps each request with time.monotonic() as it reaches the gateway, before its body is
    read and validated (request.state.arrival_s): latency metrics count from arrival."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope.setdefault("state", {})["arrival_s"] = time.monotonic()
        await self.app(scope, receive, send)


class ApiKeyGuard:
    """401 without `Authorization: Bearer <key>` (or the admin token), except on `open_paths`
    (health, metrics)."""

    def __init__(self, app: ASGIApp, api_key: str, open_paths: Collection[str],
                 admin_token: str = "") -> None:
        self.app = app
        self._api_key = api_key
        self._admin_token = admin_token
        self._open_paths = frozenset(open_paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["path"] not in self._open_paths
                and not is_authorized(self._api_key, Headers(scope=scope).get("authorization"),
                                      self._admin_token)):
            response = error_response(
                HTTPStatus.UNAUTHORIZED, "a valid API key is required: header "
                "'Authorization: Bearer <key>'", code=Reason.UNAUTHENTICATED)
            response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimit:
    """413 for a body over `max_bytes`: by its Content-Length at once, else while it arrives."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self._max_bytes = max_bytes

    def _too_large(self, num_bytes: int | str) -> str:
        return f"the request body must be at most {self._max_bytes} bytes, got {num_bytes}"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = Headers(scope=scope).get("content-length", "")
        if length.isdigit() and int(length) > self._max_bytes:
            await error_response(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                 self._too_large(int(length)), code=Reason.LIMIT_EXCEEDED
                                 )(scope, receive, send)
            return
        num_received = 0

        async def limited_receive() -> Message:
            nonlocal num_received
            message = await receive()
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > self._max_bytes:
                    # FastAPI passes an HTTPException raised while reading the body through
                    raise HTTPException(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                                        self._too_large(f"more than {self._max_bytes}"))
            return message

        await self.app(scope, limited_receive, send)
