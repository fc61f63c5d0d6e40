"""uvicorn serving an ASGI app on the caller's event loop, beside the gateway's gRPC server:
no threads, no signal handlers of its own (the gateway's SIGTERM handling drains both doors).
With the gateway's public TLS it serves HTTPS with the same certificate (and client CA)."""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl

import uvicorn
from pagedserve.services.common.config import PublicTlsConfig
from starlette.types import ASGIApp

logger = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening socket on host:port; port 0 = any free port. Its `proto` must say TCP:
    asyncio sets TCP_NODELAY only on accepted sockets whose proto is IPPROTO_TCP, and
    `socket.create_server` leaves it 0, so each SSE event written after the response headers
    waited for the client's delayed ACK (~40 ms on Linux) under Nagle's algorithm."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048)
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=sock.detach())


class HttpServer:
    def __init__(self, app: ASGIApp, sock: socket.socket,
                 tls: PublicTlsConfig | None = None) -> None:
        self._socket = sock
        self.port: int = sock.getsockname()[1]
        is_tls = tls is not None and tls.is_enabled
        self.scheme = "https" if is_tls else "http"
        tls_options = {} if not is_tls else {
            "ssl_certfile": tls.public_tls_cert, "ssl_keyfile": tls.public_tls_key,
            "ssl_ca_certs": tls.public_tls_client_ca or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.public_tls_client_ca else ssl.CERT_NONE}
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                timeout_keep_alive=30, **tls_options)
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        self._main_loop: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self._server.startup(sockets=[self._socket])
        self._main_loop = asyncio.create_task(self._server.main_loop())
        logger.info("OpenAI-compatible HTTP API (%s) on port %d", self.scheme, self.port)

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; responses still streaming after `grace_s` are cancelled."""
        if self._main_loop is None:
            return
        self._server.should_exit = True
        await self._main_loop
        self._main_loop = None
        self._server.config.timeout_graceful_shutdown = max(grace_s, 0.01)
        await self._server.shutdown(sockets=[self._socket])
        logger.info("HTTP server on port %d stopped", self.port)
