"""How fast a grpc.aio server starts new calls while its event loop is busy: --num-calls calls
sent at once to a server whose loop runs a callback of --turn-ms CPU every turn (a stand-in
for a saturated gateway), and the time from each call's send to its handler's entry.

grpc.aio keeps one request for a new call open per registered method and asks for the next
only after its serving task has woken on the last one, a few loop turns later; calls that arrive
meanwhile wait in gRPC's core. So on a loop with long turns new calls start at a rate set by the
turn, not by the CPU they need. --servers N runs N servers in the process on one port
(SO_REUSEPORT), each with its own accept path; the clients open --connections connections.

    python -m bench.grpc_accept
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import struct
import time

import grpc

from bench.common import finish, percentiles, quiet_logging

log = logging.getLogger("bench.grpc_accept")
SERVICE, METHOD = "bench.Accept", "Enter"


async def _enter(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return struct.pack("d", time.perf_counter())


def _spin(loop: asyncio.AbstractEventLoop, turn_s: float) -> None:
    end = time.perf_counter() + turn_s
    while time.perf_counter() < end:
        pass
    loop.call_soon(_spin, loop, turn_s)


def server_process(num_servers: int, turn_ms: float, ports, stop) -> None:
    async def run() -> None:
        servers, port = [], 0
        for _ in range(num_servers):
            server = grpc.aio.server(options=[("grpc.so_reuseport", int(num_servers > 1))])
            server.add_registered_method_handlers(
                SERVICE, {METHOD: grpc.unary_unary_rpc_method_handler(_enter)})
            port = server.add_insecure_port(f"127.0.0.1:{port}")
            servers.append(server)
        for server in servers:
            await server.start()
        ports.put(port)
        loop = asyncio.get_running_loop()
        if turn_ms > 0:
            loop.call_soon(_spin, loop, turn_ms / 1e3)
        await loop.run_in_executor(None, stop.wait)

    asyncio.run(run())


async def _send_all(port: int, num_calls: int, num_connections: int) -> list[float]:
    # a local subchannel pool each: one TCP connection per channel
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(num_connections)]
    calls = [c.unary_unary(f"/{SERVICE}/{METHOD}", _registered_method=True) for c in channels]
    try:
        await asyncio.gather(*(call(b"") for call in calls))  # connected

        async def one(i: int) -> float:
            sent = time.perf_counter()
            entry = struct.unpack("d", await calls[i % num_connections](b""))[0]
            return entry - sent

        return list(await asyncio.gather(*(one(i) for i in range(num_calls))))
    finally:
        for channel in channels:
            await channel.close()


def measure(num_servers: int, turn_ms: float, args: argparse.Namespace) -> dict:
    ctx = multiprocessing.get_context("spawn")
    ports, stop = ctx.Queue(), ctx.Event()
    server = ctx.Process(target=server_process, args=(num_servers, turn_ms, ports, stop),
                         daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        asyncio.run(_send_all(port, args.num_calls, args.connections))  # warm-up
        load = os.getloadavg()[0]
        waits_s = asyncio.run(_send_all(port, args.num_calls, args.connections))
    finally:
        stop.set()
        server.join(10)
        if server.is_alive():
            server.kill()
    last_s = max(waits_s)
    result = {"servers": num_servers, "turn_ms": turn_ms, "wait_ms": percentiles(
        [w * 1e3 for w in waits_s]), "calls_started_per_s": len(waits_s) / last_s,
        "load_average_1m": load}
    if turn_ms > 0:
        result["turns_per_call"] = last_s / len(waits_s) * num_servers / (turn_ms / 1e3)
    log.info("%d server(s), turn %g ms: send to entry p50 %.1f ms, max %.1f ms, %.0f calls "
             "started per s, load %.1f", num_servers, turn_ms, result["wait_ms"]["p50"],
             last_s * 1e3, result["calls_started_per_s"], load)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-calls", type=int, default=256)
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--turn-ms", type=float, nargs="+", default=[0.0, 1.0, 4.0])
    parser.add_argument("--servers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    results = [measure(n, turn_ms, args) for turn_ms in args.turn_ms for n in args.servers]
    line = f"grpc.aio calls started per second, {args.num_calls} calls at once: " + "; ".join(
        f"{r['servers']} server(s) turn {r['turn_ms']:g} ms {r['calls_started_per_s']:.0f}/s"
        for r in results)
    return finish("grpc_accept", args, line, results)


if __name__ == "__main__":
    main()
