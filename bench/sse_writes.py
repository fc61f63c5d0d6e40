"""The OpenAI door's per-event write path alone: the HTTP server's CPU per streamed SSE event when
the events go through ASGI `send` (every middleware's send wrapper, uvicorn's checks, h11's
event objects; what the door did before) against its connection_guard.StreamWriter (what it does
now), alternating in one run against the same server, middleware stack and clients.

Each of --streams streams waits for a clock that wakes it every --step-ms (as the delta buffer
wakes a response once per engine step) and writes one completion chunk event; the clients, in
a process of their own, read raw sockets. The figure is the server process's CPU per event;
the best of --repeats rounds is kept, so a shared host's noise does not enter it.

    python -m bench.sse_writes
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import selectors
import socket
import time

from fastapi import FastAPI, Request
from pagedserve.services.gateway.openai import sse
from pagedserve.services.gateway.openai.connection_guard import STREAM_WRITER
from pagedserve.services.gateway.openai.middleware import ArrivalTime, BodyLimit
from pagedserve.services.gateway.openai.server import HttpServer, bind_socket

from bench.common import finish

PATHS = {"send": "/send", "writer": "/writer"}
EVENT = sse.event('{"id":"cmpl-0123456789abcdef0123456789abcdef","object":"text_completion",'
                  '"created":1764000000,"model":"SmolLM2-1.7B","system_fingerprint":'
                  '"fp_0123456789","choices":[{"index":0,"text":" capital","logprobs":null,'
                  '"finish_reason":null}]}')


class Clock:
    """One future per waiting stream, all resolved each step."""

    def __init__(self) -> None:
        self.waiters: list[asyncio.Future[None]] = []

    async def tick(self, step_s: float) -> None:
        while True:
            await asyncio.sleep(step_s)
            waiters, self.waiters = self.waiters, []
            for waiter in waiters:
                waiter.set_result(None)

    async def wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self.waiters.append(waiter)
        await waiter


def build_app(clock: Clock, num_events: int) -> FastAPI:
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)

    async def events():
        for _ in range(num_events):
            await clock.wait()
            yield EVENT

    async def stream(request: Request) -> sse.EventStreamResponse:
        if request.url.path == PATHS["send"]:
            request.scope["extensions"].pop(STREAM_WRITER, None)
        return sse.EventStreamResponse(events(), lambda: None, asyncio.Event())

    for path in PATHS.values():
        app.add_api_route(path, stream)
    app.add_middleware(BodyLimit, max_bytes=1 << 20)
    app.add_middleware(ArrivalTime)
    return app


def read_streams(port: int, path: str, num_streams: int) -> None:
    """Opens the streams, then reads each until its last chunk."""
    selector = selectors.DefaultSelector()
    request = f"GET {path} HTTP/1.1\r\nhost: bench\r\n\r\n".encode()
    tails = {}
    for _ in range(num_streams):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(request)
        sock.setblocking(False)
        selector.register(sock, selectors.EVENT_READ)
        tails[sock] = b""
    while tails:
        for key, _ in selector.select():
            sock = key.fileobj
            data = sock.recv(1 << 16)
            tail = (tails[sock] + data)[-5:]
            if not data or tail == b"0\r\n\r\n":
                selector.unregister(sock)
                sock.close()
                del tails[sock]
            else:
                tails[sock] = tail


async def one_round(port: int, path: str, args: argparse.Namespace) -> float:
    """The server's CPU seconds per event over one round of every stream."""
    ctx = multiprocessing.get_context("spawn")
    clients = ctx.Process(target=read_streams, args=(port, path, args.streams), daemon=True)
    cpu0 = time.process_time()
    clients.start()
    while clients.is_alive():
        await asyncio.sleep(0.05)
    if clients.exitcode:
        raise RuntimeError(f"the clients failed (exit code {clients.exitcode})")
    return (time.process_time() - cpu0) / (args.streams * args.events)


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    clock = Clock()
    ticking = asyncio.create_task(clock.tick(args.step_ms / 1e3))
    http = HttpServer(build_app(clock, args.events), bind_socket("127.0.0.1", 0))
    await http.start()
    per_event_us: dict[str, list[float]] = {name: [] for name in PATHS}
    try:
        for _ in range(args.repeats):
            for name, path in PATHS.items():
                per_event_us[name].append(1e6 * await one_round(http.port, path, args))
    finally:
        ticking.cancel()
        await http.stop(1.0)
    return per_event_us


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=128)
    parser.add_argument("--events", type=int, default=200, help="per stream and round")
    parser.add_argument("--step-ms", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=5, help="rounds (send, writer each)")
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    per_event_us = asyncio.run(run(args))
    best = {name: min(us) for name, us in per_event_us.items()}
    line = (f"HTTP server CPU per SSE event, {args.streams} streams, best of {args.repeats}: "
            f"through send {best['send']:.1f} us, through StreamWriter {best['writer']:.1f} us")
    return finish("sse_writes", args, line, [{"path": name, "us_per_event": us}
                                             for name, us in per_event_us.items()], best=best)


if __name__ == "__main__":
    main()
