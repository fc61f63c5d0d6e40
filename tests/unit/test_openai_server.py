"""The HTTP door's sockets: every accepted connection has TCP_NODELAY, so an SSE event written
right after the response headers is not held back by Nagle's algorithm until the client's
delayed ACK (it cost ~40 ms of TTFT per streamed request); a stream's events, written past h11,
are framed as h11 frames them."""

import asyncio
import socket

import h11
from pagedserve.services.gateway.openai import sse
from pagedserve.services.gateway.openai.server import HttpServer, bind_socket
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route


def test_bind_socket_is_tcp():
    sock = bind_socket("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
        assert sock.getsockname()[1] > 0
    finally:
        sock.close()


def test_accepted_connections_have_nodelay():
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])

    async def main() -> list[int]:
        http = HttpServer(app, bind_socket("127.0.0.1", 0))
        await http.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
            writer.write(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            await reader.readuntil(b"ok")
            connections = http._server.server_state.connections
            options = [c.transport.get_extra_info("socket").getsockopt(
                socket.IPPROTO_TCP, socket.TCP_NODELAY) for c in connections]
            writer.close()
            return options
        finally:
            await http.stop(0.1)

    options = asyncio.run(main())
    assert options and all(options)


def test_a_stream_its_client_does_not_read_stops_after_a_bounded_number_of_events():
    """What the kernel may hold under a client that stops reading is
    http_stream_send_buffer_bytes, not megabytes: the writes wait (and the gateway's
    backpressure counts the tokens) after about 2 × 16 KiB of 250-byte events, plus what the
    client's own 4 KiB receive buffer takes (it was 11,000 events, 2.8 MB, on loopback)."""
    num_sent = 0

    async def events():
        nonlocal num_sent
        while True:
            num_sent += 1
            yield sse.event("x" * 240)
            await asyncio.sleep(0)

    async def stream(request):
        return sse.EventStreamResponse(events(), lambda: None, asyncio.Event())

    app = Starlette(routes=[Route("/", stream)])

    async def main() -> int:
        http = HttpServer(app, bind_socket("127.0.0.1", 0))
        await http.start()
        client = socket.socket()
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(client, ("127.0.0.1", http.port))
            client.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            while True:  # until the writes block
                before = num_sent
                await asyncio.sleep(0.5)
                if num_sent == before:
                    return num_sent
        finally:
            client.close()
            await http.stop(0.1)

    assert 0 < asyncio.run(main()) <= 400


def _serve_events(events: list[str], request: bytes) -> bytes:
    """What a raw client that sends `request` reads until the server closes or ends the body."""
    async def stream(request):
        async def generate():
            for event in events:
                yield event
        return sse.EventStreamResponse(generate(), lambda: None, asyncio.Event())

    app = Starlette(routes=[Route("/", stream)])

    async def main() -> bytes:
        http = HttpServer(app, bind_socket("127.0.0.1", 0))
        await http.start()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", http.port)
            writer.write(request)
            received = b""
            while not received.endswith(b"0\r\n\r\n") and (chunk := await reader.read(65536)):
                received += chunk
            writer.close()
            return received
        finally:
            await http.stop(0.1)

    return asyncio.run(main())


def test_events_reach_an_http11_client_as_chunks_h11_reads_back():
    """The events are written past h11 (connection_guard.StreamWriter): framed as h11 would."""
    events = [sse.event('{"text":"a"}'), sse.event('{"text":"\\u00e9\\n"}'), sse.DONE]
    received = _serve_events(events, b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    client = h11.Connection(h11.CLIENT)
    client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    client.send(h11.EndOfMessage())
    client.receive_data(received)
    body, response = b"", None
    while (event := client.next_event()) not in (h11.NEED_DATA, h11.PAUSED):
        if isinstance(event, h11.Response):
            response = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
    assert response is not None and response.status_code == 200
    assert (b"transfer-encoding", b"chunked") in response.headers
    assert isinstance(event, h11.EndOfMessage)
    assert body == "".join(events).encode()


def test_events_reach_an_http10_client_unframed_until_the_close():
    events = [sse.event('{"text":"a"}'), sse.DONE]
    received = _serve_events(events, b"GET / HTTP/1.0\r\n\r\n")
    head, _, body = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" not in head.lower()
    assert body == "".join(events).encode()
