"""What uvicorn lacks to keep clients from holding the HTTP door's descriptors: a deadline for a
request's headers (from the connection's opening, so a client that never sends a request line is
closed too) and one for its body, a cap on the connections of one client address, and the writer
a streamed response's events go through (StreamWriter): straight to the connection, over a small
send buffer (so backpressure counts what a client leaves unread)."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from pagedserve.services.common.errors import Reason
from pagedserve.services.gateway.config import ConnectionLimitsConfig
from pagedserve.services.gateway.openai.errors import error_body, error_response
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

# scope["extensions"][STREAM_WRITER]: the request's StreamWriter (none for HEAD)
STREAM_WRITER = "pagedserve.stream_writer"


def _timeout_response(message: str) -> bytes:
    body = error_body(HTTPStatus.REQUEST_TIMEOUT, message,
                      code=Reason.LIMIT_EXCEEDED).model_dump_json().encode()
    return (b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))


class ConnectionGuard:
    """One per HTTP server: the limits, and the open connections of each client address."""

    def __init__(self, limits: ConnectionLimitsConfig) -> None:
        self.limits = limits
        self._num_by_host: Counter[str] = Counter()

    def protocol(self, **kwargs: Any) -> GuardedProtocol:
        """uvicorn's protocol factory (its `http` option)."""
        return GuardedProtocol(self, **kwargs)

    def open(self, host: str) -> bool:
        """Counts a connection of `host`; False if it is one too many."""
        self._num_by_host[host] += 1
        cap = self.limits.max_http_connections_per_client
        return not cap or self._num_by_host[host] <= cap

    def close(self, host: str) -> None:
        self._num_by_host[host] -= 1
        if not self._num_by_host[host]:
            del self._num_by_host[host]


class GuardedProtocol(H11Protocol):
    """uvicorn's h11 protocol (always h11, whose parser also bounds the headers at 16 KiB, even
    where httptools is installed) with the guard's deadlines and per-address cap. Between
    requests (after a response, before the next request's first byte) uvicorn's keep-alive
    timeout applies instead."""

    def __init__(self, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._guard = guard
        self._host = ""
        self._deadline: asyncio.TimerHandle | None = None
        self._on_timeout: Callable[[], None] | None = None
        self._has_request_bytes = False
        self._read_cycle: RequestResponseCycle | None = None  # the request being read

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._host = self.client[0] if self.client else ""
        if not self._guard.open(self._host):
            cap = self._guard.limits.max_http_connections_per_client
            refusal = error_response(
                HTTPStatus.TOO_MANY_REQUESTS, f"too many connections from {self._host}: at "
                f"most max_http_connections_per_client={cap}", code=Reason.RATE_LIMITED)
            refusal.headers["Connection"] = "close"
            self.app = refusal
        self._arm(self._guard.limits.http_header_timeout_s, self._on_header_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._guard.close(self._host)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self._is_between_requests():
            self._arm(self._guard.limits.http_header_timeout_s, self._on_header_timeout)
        self._has_request_bytes = True
        super().data_received(data)

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None:
            return
        if cycle is not self._read_cycle:  # a request's headers arrived
            self._read_cycle = cycle
            self._has_request_bytes = False
            if cycle.scope["method"] != "HEAD":
                cycle.scope.setdefault("extensions", {})[STREAM_WRITER] = StreamWriter(
                    self, cycle, self._guard.limits.http_stream_send_buffer_bytes)
            self._disarm()
            if cycle.more_body:
                self._arm(self._guard.limits.http_body_timeout_s, self._on_body_timeout)
        elif not cycle.more_body and self._on_timeout == self._on_body_timeout:
            self._disarm()

    def _is_between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _arm(self, timeout_s: float, on_timeout: Callable[[], None]) -> None:
        self._disarm()
        self._on_timeout = on_timeout
        self._deadline = self.loop.call_later(timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._on_timeout = None

    def _expire(self) -> None:
        on_timeout = self._on_timeout
        self._deadline = self._on_timeout = None
        if on_timeout is not None and not self.transport.is_closing():
            on_timeout()

    def _on_header_timeout(self) -> None:
        """A client that sent nothing gets no answer (there is no request to answer, and no
        reader is known to wait for one); partial headers get 408."""
        if self._has_request_bytes:
            timeout_s = self._guard.limits.http_header_timeout_s
            self.transport.write(_timeout_response(
                f"the request's headers did not arrive within http_header_timeout_s="
                f"{timeout_s:g}"))
        self.transport.close()

    def _on_body_timeout(self) -> None:
        if self.cycle is not None and not self.cycle.response_started:
            timeout_s = self._guard.limits.http_body_timeout_s
            self.transport.write(_timeout_response(
                f"the request's body did not arrive within http_body_timeout_s={timeout_s:g}"))
        self.transport.close()


class StreamWriter:
    """A streamed response's body events written to its connection as uvicorn would write them
    (the same checks, h11's framing), past the layers each `send` goes through: every
    middleware's send wrapper, a message dict, uvicorn's checks and h11's event objects cost
    more per token than the socket write. The response's start and end still go through `send`,
    which keeps uvicorn's and h11's state; h11 checks no length in a body of unknown length."""

    __slots__ = ("_protocol", "_cycle", "_send_buffer_bytes", "_is_chunked")

    def __init__(self, protocol: GuardedProtocol, cycle: RequestResponseCycle,
                 send_buffer_bytes: int) -> None:
        self._protocol = protocol
        self._cycle = cycle
        self._send_buffer_bytes = send_buffer_bytes
        # a response without Content-Length: chunked to an HTTP/1.1 client, else sent until
        # the connection closes (h11's choice)
        self._is_chunked = protocol.conn.their_http_version == b"1.1"

    def limit_send_buffer(self) -> None:
        """The kernel holds at most http_stream_send_buffer_bytes (Linux counts twice that,
        overhead included) of this connection's output, and the transport nothing above it:
        a response's writes wait as soon as the kernel takes no more, so a client that stops
        reading stalls its stream (and its backpressure count rises) within a few events."""
        transport = self._protocol.transport
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self._send_buffer_bytes)
        transport.set_write_buffer_limits(high=0)

    @property
    def must_wait(self) -> bool:
        """The client has not taken the last write yet: `await wait()` before the next."""
        return self._protocol.flow.write_paused and not self._cycle.disconnected

    async def wait(self) -> None:
        await self._protocol.flow.drain()

    def write(self, data: bytes) -> None:
        """A piece of the body, once the response started through `send`; dropped once the
        client is gone (as uvicorn drops it). Empty, it is nothing (chunked, it would end the
        body)."""
        if not data or self._cycle.disconnected:
            return
        if self._is_chunked:
            data = b"%x\r\n%b\r\n" % (len(data), data)
        self._protocol.transport.write(data)
