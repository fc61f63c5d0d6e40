"""uvicorn serving an ASGI app on the caller's event loop, beside the gateway's gRPC server:
no threads, no signal handlers of its own (the gateway's SIGTERM handling drains both doors).
With the gateway's public TLS it serves HTTPS with the same certificate (and client CA).
Connections are bounded by the gateway's ConnectionLimitsConfig (see connection_guard)."""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import socket
import ssl
import time
from typing import Any

import uvicorn
from pagedserve.services.common.config import PublicTlsConfig
from pagedserve.services.gateway.config import ConnectionLimitsConfig
from pagedserve.services.gateway.openai.connection_guard import ConnectionGuard
from starlette.types import ASGIApp

logger = logging.getLogger(__name__)

ACCEPT_ERROR_LOG_INTERVAL_S = 10.0
_OUT_OF_RESOURCES = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
# descriptors the gateway needs beside its HTTP connections (gRPC, channels, files)
_RESERVED_DESCRIPTORS = 1024


def bind_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A listening socket on host:port; port 0 = any free port; `reuse_port`: shared with the
    other processes that bind it so (SO_REUSEPORT, the kernel balancing new connections). Its
    `proto` must say TCP: asyncio sets TCP_NODELAY only on accepted sockets whose proto is
    IPPROTO_TCP, and `socket.create_server` leaves it 0, so each SSE event written after the
    response headers waited for the client's delayed ACK (~40 ms on Linux) under Nagle's
    algorithm."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048,
                                reuse_port=reuse_port)
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, fileno=sock.detach())


class AcceptErrorLog:
    """An event loop exception handler that turns asyncio's report of a failed accept() for
    want of descriptors (a traceback per try: it retries the whole backlog in a loop, thousands
    a second) into one line per ACCEPT_ERROR_LOG_INTERVAL_S; other reports go on as before."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._previous = loop.get_exception_handler()
        self._num_failed = 0
        self._next_log_s = 0.0

    def install(self) -> None:
        self._loop.set_exception_handler(self)

    def uninstall(self) -> None:
        if self._loop.get_exception_handler() is self:
            self._loop.set_exception_handler(self._previous)

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        error = context.get("exception")
        if isinstance(error, OSError) and error.errno in _OUT_OF_RESOURCES and \
                context.get("message", "").startswith("socket.accept()"):
            self._num_failed += 1
            now = time.monotonic()
            if now >= self._next_log_s:
                logger.error("HTTP connections cannot be accepted: %s (%d failed accept() "
                             "calls since the last report; see max_http_connections)",
                             error.strerror, self._num_failed)
                self._num_failed = 0
                self._next_log_s = now + ACCEPT_ERROR_LOG_INTERVAL_S
            return
        if self._previous is not None:
            self._previous(loop, context)
        else:
            loop.default_exception_handler(context)


def fit_open_file_limit(max_connections: int) -> None:
    """Raise the soft open-file limit (up to the hard one) so that max_connections fit beside
    the descriptors the gateway needs otherwise; warn where they cannot."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = max_connections + _RESERVED_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
        soft = raised
    if soft != resource.RLIM_INFINITY and soft < wanted:
        logger.warning("the open-file limit (%d) is below max_http_connections (%d) + %d: "
                       "connections may fail before the cap refuses them", soft, max_connections,
                       _RESERVED_DESCRIPTORS)


class HttpServer:
    def __init__(self, app: ASGIApp, sock: socket.socket,
                 tls: PublicTlsConfig | None = None,
                 limits: ConnectionLimitsConfig | None = None) -> None:
        self._socket = sock
        self.port: int = sock.getsockname()[1]
        is_tls = tls is not None and tls.is_enabled
        self.scheme = "https" if is_tls else "http"
        tls_options = {} if not is_tls else {
            "ssl_certfile": tls.public_tls_cert, "ssl_keyfile": tls.public_tls_key,
            "ssl_ca_certs": tls.public_tls_client_ca or None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if tls.public_tls_client_ca else ssl.CERT_NONE}
        limits = limits or ConnectionLimitsConfig()
        self._limits = limits
        # uvicorn refuses a request with 503 once its connections reach limit_concurrency,
        # this one included
        config = uvicorn.Config(app, lifespan="off", log_config=None, access_log=False,
                                http=ConnectionGuard(limits).protocol,
                                timeout_keep_alive=limits.http_keep_alive_timeout_s,
                                limit_concurrency=limits.max_http_connections + 1,
                                **tls_options)
        config.load()
        self._server = uvicorn.Server(config)
        self._server.lifespan = config.lifespan_class(config)
        self._main_loop: asyncio.Task[None] | None = None
        self._accept_error_log: AcceptErrorLog | None = None

    async def start(self) -> None:
        fit_open_file_limit(self._limits.max_http_connections)
        self._accept_error_log = AcceptErrorLog(asyncio.get_running_loop())
        self._accept_error_log.install()
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
        if self._accept_error_log is not None:
            self._accept_error_log.uninstall()
        logger.info("HTTP server on port %d stopped", self.port)
