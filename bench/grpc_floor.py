"""The floor under the gRPC door's cost per streamed message: a grpc.aio server that does nothing
but stream ready-made GenerateStreamResponse messages (the gateway's, one token of text each) to
--concurrency client streams, and the server process's CPU per message (/proc, user + system).

Any gateway that sends one message per token pays at least this per token, so it bounds the
tokens per gateway CPU-second of bench.gateway_cpu at one token per event: the issue's 40k
over gRPC needs at most 25 µs per token in all. Both ways a handler can stream are measured:
`context.write` (the gateway's) and yielding from an async generator.

    python -m bench.grpc_floor
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os

import grpc
from pagedserve.services.rpc.v1 import gateway_pb2

from bench.common import finish, quiet_logging
from bench.serving import cpu_seconds

log = logging.getLogger("bench.grpc_floor")
METHOD = "/bench.Floor/Stream"
MESSAGE = gateway_pb2.GenerateStreamResponse(request_id="cmpl-0123456789abcdef", index=0,
                                             text=" gateway", token_ids=[28745])


def _handler(mode: str, num_messages: int) -> grpc.RpcMethodHandler:
    async def write(request: bytes, context: grpc.aio.ServicerContext) -> None:
        for _ in range(num_messages):
            await context.write(MESSAGE)

    async def generate(request: bytes, context: grpc.aio.ServicerContext):
        for _ in range(num_messages):
            yield MESSAGE

    return grpc.unary_stream_rpc_method_handler(
        write if mode == "write" else generate,
        response_serializer=gateway_pb2.GenerateStreamResponse.SerializeToString)


def server_process(mode: str, num_messages: int, ports) -> None:
    async def run() -> None:
        server = grpc.aio.server()
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "bench.Floor", {"Stream": _handler(mode, num_messages)})])
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(run())


async def _stream_all(port: int, concurrency: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stream = channel.unary_stream(
            METHOD, response_deserializer=gateway_pb2.GenerateStreamResponse.FromString)

        async def one() -> int:
            return sum([1 async for _ in stream(b"")])

        return sum(await asyncio.gather(*(one() for _ in range(concurrency))))


def measure(mode: str, args: argparse.Namespace) -> dict:
    ports = multiprocessing.Queue()
    server = multiprocessing.Process(target=server_process,
                                     args=(mode, args.messages_per_stream, ports), daemon=True)
    server.start()
    try:
        port = ports.get(timeout=60)
        asyncio.run(_stream_all(port, args.concurrency))  # warm-up: connections, allocations
        results = []
        for _ in range(args.repeats):
            load = os.getloadavg()[0]
            cpu0 = cpu_seconds(server.pid)
            num_messages = asyncio.run(_stream_all(port, args.concurrency))
            us_per_message = 1e6 * (cpu_seconds(server.pid) - cpu0) / num_messages
            results.append({"mode": mode, "num_messages": num_messages,
                            "server_us_per_message": us_per_message,
                            "messages_per_cpu_s": 1e6 / us_per_message,
                            "load_average_1m": load})
            log.info("%s: %.1f us of server CPU per message (load %.1f)", mode, us_per_message,
                     load)
        return {"mode": mode, "median_us_per_message": sorted(
            r["server_us_per_message"] for r in results)[len(results) // 2], "runs": results}
    finally:
        server.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--messages-per-stream", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    results = [measure(mode, args) for mode in ("write", "yield")]
    line = "grpc.aio floor per streamed message, server CPU: " + ", ".join(
        f"{r['mode']} {r['median_us_per_message']:.1f} us "
        f"({1e6 / r['median_us_per_message'] / 1e3:.1f}k messages per CPU-s)" for r in results)
    return finish("grpc_floor", args, line, results)


if __name__ == "__main__":
    main()
