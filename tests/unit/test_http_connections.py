"""The HTTP door's connection limits, with real sockets on 127.0.0.1: a client that sends nothing,
sends its headers or its body a trickle at a time, or idles between requests is closed; one
address past its cap gets 429, the process past its cap 503; the open-file limit is raised to fit
the cap, and running out of descriptors anyway logs one line, not a traceback per accept()."""

import asyncio
import json
import resource
import socket
import subprocess
import sys
import textwrap
import time

import pytest
from pagedserve.services.gateway.config import ConnectionLimitsConfig
from pagedserve.services.gateway.openai.server import HttpServer, bind_socket, fit_open_file_limit
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

SHORT = dict(http_header_timeout_s=0.3, http_body_timeout_s=0.3, http_keep_alive_timeout_s=0.3)
REQUEST = b"GET / HTTP/1.1\r\nhost: x\r\n\r\n"


async def echo(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"ok {len(await request.body())}")


APP = Starlette(routes=[Route("/", echo, methods=["GET", "POST"])])


def serve(body, **limits):
    """Runs `body(port)` (blocking socket code, in a thread) beside a server with `limits`."""
    async def main():
        http = HttpServer(APP, bind_socket("127.0.0.1", 0),
                          limits=ConnectionLimitsConfig(**{**SHORT, **limits}))
        await http.start()
        try:
            return await asyncio.to_thread(body, http.port)
        finally:
            await http.stop(0.1)

    return asyncio.run(main())


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def read_all(sock: socket.socket) -> bytes:
    """Everything until the server closes (a socket timeout fails the test: still open)."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def status_and_body(response: bytes) -> tuple[int, bytes]:
    head, _, body = response.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_client_that_sends_nothing_is_closed_without_an_answer():
    def body(port):
        with connect(port) as sock:
            return read_all(sock)

    assert serve(body) == b""


def test_headers_sent_a_byte_at_a_time_get_408_at_the_header_deadline():
    def body(port):
        with connect(port) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\n")
            for _ in range(100):  # 10 s of headers, far past the deadline
                try:  # the answer is looked for before each byte: none goes after the close
                    if sock.recv(65536, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                        break
                except BlockingIOError:
                    pass
                sock.sendall(b"x")
                time.sleep(0.1)
            return read_all(sock)

    status, payload = status_and_body(serve(body, http_header_timeout_s=0.5))
    assert status == 408
    assert "http_header_timeout_s=0.5" in json.loads(payload)["error"]["message"]


def test_a_body_that_never_completes_gets_408_at_the_body_deadline():
    def body(port):
        with connect(port) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n0123456789")
            return read_all(sock)

    status, payload = status_and_body(serve(body))
    assert status == 408
    assert "http_body_timeout_s=0.3" in json.loads(payload)["error"]["message"]


def test_a_slow_body_within_its_deadline_is_served():
    def body(port):
        with connect(port) as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 4\r\n"
                         b"connection: close\r\n\r\nab")
            sock.sendall(b"cd")
            return read_all(sock)

    assert status_and_body(serve(body, http_body_timeout_s=5.0)) == (200, b"ok 4")


def test_an_idle_kept_alive_connection_is_closed_after_its_request():
    def body(port):
        with connect(port) as sock:
            sock.sendall(REQUEST)
            return read_all(sock)

    status, payload = status_and_body(serve(body, http_header_timeout_s=30.0))
    assert (status, payload) == (200, b"ok 0")


def test_one_address_past_its_cap_gets_429_while_its_others_are_served():
    def body(port):
        with connect(port) as first, connect(port), connect(port) as third:
            third.sendall(REQUEST)
            refused = read_all(third)
            first.sendall(b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            return refused, read_all(first)

    refused, served = serve(body, max_http_connections_per_client=2, http_header_timeout_s=30.0)
    status, payload = status_and_body(refused)
    assert status == 429
    error = json.loads(payload)["error"]
    assert "max_http_connections_per_client=2" in error["message"]
    assert error["code"] == "RATE_LIMITED"
    assert status_and_body(served) == (200, b"ok 0")


def test_the_process_past_its_cap_answers_503():
    def body(port):
        with connect(port), connect(port), connect(port) as third:
            third.sendall(REQUEST)
            return read_all(third)

    status, _ = status_and_body(serve(body, max_http_connections=2,
                                      http_header_timeout_s=30.0))
    assert status == 503


EMFILE_SERVER = textwrap.dedent("""
    import asyncio, logging, resource, sys
    from pagedserve.services.gateway.config import ConnectionLimitsConfig
    from pagedserve.services.gateway.openai.server import HttpServer, bind_socket
    from starlette.applications import Starlette

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)

    async def main():
        limits = ConnectionLimitsConfig(max_http_connections=1000, http_header_timeout_s=60)
        http = HttpServer(Starlette(), bind_socket("127.0.0.1", 0), limits=limits)
        await http.start()
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))
        print(http.port, flush=True)
        await asyncio.sleep(60)

    asyncio.run(main())
""")


def test_running_out_of_descriptors_logs_one_line_not_a_traceback_per_accept():
    server = subprocess.Popen([sys.executable, "-c", EMFILE_SERVER], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    clients = []
    try:
        port = int(server.stdout.readline())
        for _ in range(200):  # past the server's 64 descriptors
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        with socket.create_connection(("127.0.0.1", port), timeout=5) as probe:
            probe.settimeout(2.5)  # the server keeps trying to accept meanwhile
            with pytest.raises(TimeoutError):
                probe.recv(1)
    finally:
        server.kill()
        _, log = server.communicate(timeout=10)
        for client in clients:
            client.close()
    assert log.count("Traceback") == 0
    assert 1 <= log.count("HTTP connections cannot be accepted: Too many open files") <= 2


def test_the_open_file_limit_is_raised_to_fit_the_connection_cap():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2048:
        pytest.skip(f"the hard open-file limit ({hard}) leaves no room to raise")
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    try:
        fit_open_file_limit(512)
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 512 + 1024
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
