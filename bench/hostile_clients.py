"""Hostile clients: a normal client's throughput through the local stack beside 20 streams that
never read, and beside a loop of hostile requests, against the same client alone, same run.

The stack is `python -m pagedserve.cli serve`. The normal client sends its requests one after
another (closed loop, GenerateStream, token-id prompts, greedy, ignore_eos). The phases run as
alone, beside-reading, beside-stalled, beside-hostile, alone: the baseline is the mean of the
two alone runs, so drift of the machine hits both sides. Beside-stalled: 20 streams on a channel
with a ~1 KB receive window that nobody reads (each asks for long outputs with logprobs, so its
window fills and the gateway must buffer, pause the request in the scheduler once more than
--max-unread-stream-tokens are unread (0: never, the control for backpressure), and, after
--stalled-stream-timeout-s, abort it). Beside-reading, the control: the same 20 streams, read; stalled ÷ reading is what not
reading costs the others, beyond the engine's work for 20 more requests (which on a CPU slows
every step).
Beside-hostile: another process sends, over and over, n = 2^31 - 1, a million stop strings, a
prompt just under --max-request-bytes and a 50 MB request. Target: each ratio >= 0.8 (issue 16).
The record goes to bench/results/hostile_clients-<tag>.json.

    python -m bench.hostile_clients                   # 24 requests a phase
    python -m bench.hostile_clients --quick --tag smoke
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import time

import grpc
from pagedserve.services.rpc.convert_public import sampling_params_to_proto
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pagedserve.services.text.tokenizer import Tokenizer

from bench.common import (
    DEFAULT_MODEL,
    Workload,
    finish,
    make_workload,
    quiet_logging,
    serve_process,
)
from bench.serving import ROOT, RequestTrace, RunResult, wait_serving
from pagedserve.supervisor import free_port

log = logging.getLogger("bench.hostile_clients")

TARGET_RATIO = 0.8
NUM_STALLED = 20
MAX_REQUEST_BYTES = 4 << 20


def serve_args(args: argparse.Namespace, port: int) -> list[str]:
    return ["--model", args.model, "--port", str(port), "--http-port", "0", "--device", "cpu", "--dtype", "float32",
            "--kv-cache-memory-gib", str(args.kv_cache_memory_gib), "--swap-space-gib", "0.25",
            "--max-request-bytes", str(MAX_REQUEST_BYTES),
            "--stalled-stream-timeout-s", str(args.stalled_stream_timeout_s),
            "--max-unread-stream-tokens", str(args.max_unread_stream_tokens),
            "--log-level", "ERROR"]


async def normal_client(stub, wl: Workload) -> RunResult:
    params = wl.sampling_params()
    traces = []
    start = time.perf_counter()
    for prompt, sampling, expected in zip(wl.prompts, params, wl.output_lens, strict=True):
        trace = RequestTrace(time.perf_counter())
        async for response in stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
                token_ids=common_pb2.TokenIds(token_ids=prompt),
                sampling=sampling_params_to_proto(sampling)), timeout=600):
            if response.token_ids:
                trace.chunk_times_s.append(time.perf_counter())
                trace.num_tokens += len(response.token_ids)
        if trace.num_tokens != expected:
            raise RuntimeError(f"streamed {trace.num_tokens} tokens, asked for {expected}")
        traces.append(trace)
    return RunResult(time.perf_counter() - start, traces)


def _side_streams(channel, wl: Workload, max_tokens: int) -> list:
    stub = gateway_pb2_grpc.GenerationServiceStub(channel)
    return [stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=wl.prompts[i % len(wl.prompts)]),
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=i, logprobs=20,
                                           max_tokens=max_tokens, ignore_eos=True)),
        timeout=600) for i in range(NUM_STALLED)]


async def beside_reading(address: str, stub, wl: Workload, max_tokens: int) -> RunResult:
    """The control: the normal client beside the same NUM_STALLED streams, read as they come
    (the engine's extra work without the not-reading); cancelled once the client is done."""

    async def read(call) -> None:
        async for _ in call:
            pass

    async with grpc.aio.insecure_channel(address) as channel:
        calls = _side_streams(channel, wl, max_tokens)
        readers = [asyncio.create_task(read(call)) for call in calls]
        result = await normal_client(stub, wl)
        for call in calls:
            call.cancel()
        await asyncio.gather(*readers, return_exceptions=True)
    return result


async def beside_stalled(address: str, stub, wl: Workload, max_tokens: int
                         ) -> tuple[RunResult, dict]:
    """The normal client while NUM_STALLED streams sit unread; then how those ended."""
    window = grpc.aio.insecure_channel(address, options=[
        ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
    calls = _side_streams(window, wl, max_tokens)
    try:
        result = await normal_client(stub, wl)
        ends: dict[str, int] = {}
        for call in calls:
            try:
                async for _ in call:
                    pass
                code = "OK"
            except grpc.aio.AioRpcError as error:
                code = error.code().name
            ends[code] = ends.get(code, 0) + 1
        return result, ends
    finally:
        await window.close()


def hostile_requests(vocab_size: int) -> list[gateway_pb2.GenerateRequest]:
    text = "the fox " * ((MAX_REQUEST_BYTES - 64) // 8)
    return [
        gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
            n=2**31 - 1, temperature=1.0)),
        gateway_pb2.GenerateRequest(text="hi", sampling=common_pb2.SamplingParams(
            stop=[f"s{i}" for i in range(10**6)])),
        gateway_pb2.GenerateRequest(text=text),
        gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(
            token_ids=[vocab_size // 2] * ((MAX_REQUEST_BYTES - 64) // 4))),
        gateway_pb2.GenerateRequest(text="x" * (50 << 20)),
    ]


def _send_hostile_requests(address: str, vocab_size: int, started, stopped, codes) -> None:
    """A process of its own: the requests' serialization must not take the normal client's
    GIL. `started` is set once the first answer came; `codes` gets the status-code counts once
    `stopped` is set."""
    counts: dict[str, int] = {}
    requests = hostile_requests(vocab_size)
    with grpc.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        while not stopped.is_set():
            for request in requests:
                try:
                    stub.Generate(request, timeout=120)
                    code = "OK"
                except grpc.RpcError as error:
                    code = error.code().name
                counts[code] = counts.get(code, 0) + 1
                started.set()
    codes.put(counts)


class HostileLoop:
    """Sends the hostile requests over and over from another process; `codes` counts their
    status codes once it has stopped."""

    def __init__(self, address: str, vocab_size: int) -> None:
        context = multiprocessing.get_context("spawn")
        self._started, self._stopped = context.Event(), context.Event()
        self._codes = context.Queue()
        self._process = context.Process(target=_send_hostile_requests, daemon=True, args=(
            address, vocab_size, self._started, self._stopped, self._codes))
        self.codes: dict[str, int] = {}

    def __enter__(self) -> HostileLoop:
        self._process.start()
        if not self._started.wait(300):
            raise TimeoutError("the hostile requests' process never got an answer")
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stopped.set()
        self.codes = self._codes.get(timeout=300)
        self._process.join(60)


async def run_phases(args: argparse.Namespace, address: str, vocab_size: int) -> dict:
    wl = make_workload("normal", args.num_requests, (args.prompt_len, args.prompt_len),
                       (args.output_len, args.output_len), vocab_size, seed=args.seed)
    warm = make_workload("warmup", 2, (args.prompt_len, args.prompt_len), (8, 8), vocab_size,
                         seed=args.seed + 1)
    besides = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        await normal_client(stub, warm)
        alone_first = await normal_client(stub, wl)
        if not args.stalled_only:
            reading = await beside_reading(address, stub, wl, args.stalled_max_tokens)
        stalled, stalled_ends = await beside_stalled(address, stub, wl, args.stalled_max_tokens)
        besides.append(("stalled", stalled, {"stalled_stream_ends": stalled_ends}))
        if not args.stalled_only:
            with HostileLoop(address, vocab_size) as loop:
                beside_hostile = await normal_client(stub, wl)
            besides.append(("hostile", beside_hostile, {"hostile_status_codes": loop.codes}))
        alone_last = await normal_client(stub, wl)
    alone_tok_s = (alone_first.summary()["output_tok_s"]
                   + alone_last.summary()["output_tok_s"]) / 2
    out = {**wl.describe(), "alone_tok_s": alone_tok_s,
           "alone_runs": [alone_first.summary(), alone_last.summary()]}
    if not args.stalled_only:
        out["beside_reading"] = reading.summary()
        out["stalled_vs_reading"] = (stalled.summary()["output_tok_s"]
                                     / out["beside_reading"]["output_tok_s"])
    for name, run, extra in besides:
        summary = run.summary()
        ratio = summary["output_tok_s"] / alone_tok_s
        out[f"beside_{name}"] = {**summary, **extra, "ratio_vs_alone": ratio,
                                 "target": {"target": TARGET_RATIO, "met": ratio >= TARGET_RATIO}}
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-requests", type=int, default=24,
                        help="the normal client's requests in each phase")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--stalled-max-tokens", type=int, default=1024)
    parser.add_argument("--stalled-stream-timeout-s", type=float, default=30.0,
                        help="the gateway's flag: how long an unread stream lives")
    parser.add_argument("--max-unread-stream-tokens", type=int, default=16,
                        help="the gateway's flag: backpressure threshold (0: off)")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--stalled-only", action="store_true",
                        help="only alone, beside the unread streams, alone (no control, no "
                             "hostile requests): the backpressure figure on a busy machine")
    parser.add_argument("--quick", action="store_true",
                        help="4 short requests a phase, short stalled streams (a smoke run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args(argv)
    if args.quick:
        args.num_requests, args.prompt_len, args.output_len = 4, 16, 16
        args.stalled_max_tokens = 256
        args.kv_cache_memory_gib = min(args.kv_cache_memory_gib, 0.05)
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    port = free_port()
    address = f"127.0.0.1:{port}"
    with serve_process(serve_args(args, port), ROOT) as stack:
        wait_serving(address, stack, args.startup_timeout_s)
        vocab_size = Tokenizer.from_pretrained(args.model).vocab_size
        result = asyncio.run(run_phases(args, address, vocab_size))
    stalled = result["beside_stalled"]
    if args.stalled_only:
        runs = " and ".join(f"{r['output_tok_s']:.1f}" for r in result["alone_runs"])
        line = (f"hostile_clients: alone {result['alone_tok_s']:.1f} tok/s (runs {runs}); "
                f"beside {NUM_STALLED} unread streams {stalled['output_tok_s']:.1f} tok/s = "
                f"{stalled['ratio_vs_alone']:.2f}x (target >= {TARGET_RATIO}x: "
                f"{'met' if stalled['target']['met'] else 'MISSED'})")
        return finish("hostile_clients", args, line, result, model=args.model, dtype="float32")
    hostile = result["beside_hostile"]
    line = (f"hostile_clients: alone {result['alone_tok_s']:.1f} tok/s; beside {NUM_STALLED} "
            f"unread streams {stalled['output_tok_s']:.1f} tok/s = "
            f"{stalled['ratio_vs_alone']:.2f}x ({result['stalled_vs_reading']:.2f}x beside the "
            f"same streams read); beside hostile requests "
            f"{hostile['output_tok_s']:.1f} tok/s = {hostile['ratio_vs_alone']:.2f}x "
            f"(target >= {TARGET_RATIO}x: "
            f"{'met' if stalled['target']['met'] and hostile['target']['met'] else 'MISSED'})")
    return finish("hostile_clients", args, line, result, model=args.model, dtype="float32")


if __name__ == "__main__":
    main()
