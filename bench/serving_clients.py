"""bench.serving's load generator: N closed-loop streaming clients spread over K processes.

Each process has its own event loop and its own gRPC channel or httpx client and runs its share
of the N streams; all of them take prompt indices from one shared counter, so the closed loop
(N requests in flight, the next taken as one ends) and the request count are those of a single
process. A process connects first (one one-token request per stream), reports ready and waits
for the start signal; the parent starts all processes at once and merges their traces. Each
process times its own CPU (every thread) over the timed run, so a record shows whether a client
process, rather than the stack, was the bottleneck.

This module imports neither torch nor the engine, and a client process does not re-import the
parent's __main__ (see `start_processes`): it starts in a fraction of a second and stays small.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import math
import multiprocessing
import os
import queue as queue_mod
import sys
import time
import types
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc
import httpx
from pagedserve.services.common.gc_tuning import tune_gc_after_startup
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.convert_public import sampling_params_to_proto
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

STREAMS_PER_PROCESS = 32
SATURATED_BUSY = 0.8  # a client process busier than this may have bounded what it measured
_START_TIMEOUT_S = 300.0
_RUN_TIMEOUT_S = 1800.0  # a timed run's wall limit: a hung client must not hang the bench


@dataclass(slots=True)
class RequestTrace:
    """Arrival times (perf_counter seconds, one clock for all processes of the host) of one
    request's messages that carry text or the finish reason: the one event both doors show (an
    OpenAI chunk has no token ids, and a gRPC message may carry ids whose text the detokenizer
    still holds back). The in-process baseline times the steps that bring token ids."""

    submit_s: float
    chunk_times_s: list[float] = field(default_factory=list)
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Requests:
    """Token-id prompts and the exact number of tokens each must stream (greedy, ignore_eos)."""

    prompts: list[list[int]]
    output_lens: list[int]


@dataclass(frozen=True, slots=True)
class ClientReport:
    """One client process's timed run."""

    traces: list[RequestTrace]
    num_streams: int
    start_s: float
    end_s: float
    cpu_s: float

    @property
    def busy(self) -> float:
        """CPU seconds per wall second: 1.0 is one core kept busy."""
        return self.cpu_s / max(self.end_s - self.start_s, 1e-9)


def default_client_processes(concurrency: int, num_cores: int) -> int:
    """One process per STREAMS_PER_PROCESS streams, on at most half the cores (the stack needs
    the rest)."""
    return max(1, min(math.ceil(concurrency / STREAMS_PER_PROCESS), num_cores // 2, concurrency))


def split_streams(concurrency: int, num_processes: int) -> list[int]:
    base, extra = divmod(concurrency, num_processes)
    return [base + (j < extra) for j in range(num_processes)]


# one closed-loop stream: sends requests until take() has no index left
StreamFn = Callable[[Requests, Callable[[], int | None], list[RequestTrace]], Awaitable[None]]


async def _grpc_stream(stub, reqs: Requests, take: Callable[[], int | None],
                       traces: list[RequestTrace]) -> None:
    while (i := take()) is not None:
        params = SamplingParams(temperature=0.0, max_tokens=reqs.output_lens[i], ignore_eos=True)
        request = gateway_pb2.GenerateStreamRequest(
            token_ids=common_pb2.TokenIds(token_ids=reqs.prompts[i]),
            sampling=sampling_params_to_proto(params))
        trace = RequestTrace(time.perf_counter())
        async for delta in stub.GenerateStream(request, timeout=600):
            if delta.text or delta.finish_reason:
                trace.chunk_times_s.append(time.perf_counter())
            trace.num_tokens += len(delta.token_ids)
        if trace.num_tokens != reqs.output_lens[i]:
            raise RuntimeError(f"request {i} streamed {trace.num_tokens} tokens, "
                               f"asked for {reqs.output_lens[i]}")
        traces.append(trace)


async def _http_stream(http: httpx.AsyncClient, reqs: Requests, take: Callable[[], int | None],
                       traces: list[RequestTrace]) -> None:
    """Token counts come from the last chunk's usage; chunk times from the chunks with text (or
    the finish reason), as the gRPC client's."""
    while (i := take()) is not None:
        body = {"prompt": reqs.prompts[i], "max_tokens": reqs.output_lens[i],
                "temperature": 0.0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        trace = RequestTrace(time.perf_counter())
        async with http.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                choices = chunk["choices"]
                if choices and (choices[0]["text"] or choices[0]["finish_reason"]):
                    trace.chunk_times_s.append(time.perf_counter())
                if chunk.get("usage"):
                    trace.num_tokens = chunk["usage"]["completion_tokens"]
        if trace.num_tokens != reqs.output_lens[i]:
            raise RuntimeError(f"request {i} streamed {trace.num_tokens} tokens over HTTP, "
                               f"asked for {reqs.output_lens[i]}")
        traces.append(trace)


def _local_taker(num_requests: int) -> Callable[[], int | None]:
    indices = iter(range(num_requests))
    return lambda: next(indices, None)


def _shared_taker(counter, num_requests: int) -> Callable[[], int | None]:
    def take() -> int | None:
        with counter.get_lock():
            i = counter.value
            counter.value = i + 1
        return i if i < num_requests else None
    return take


async def _streams(stream: StreamFn, reqs: Requests, take: Callable[[], int | None],
                   num_streams: int) -> list[RequestTrace]:
    traces: list[RequestTrace] = []
    await asyncio.gather(*(stream(reqs, take, traces) for _ in range(num_streams)))
    return traces


async def _run_client(door: str, target: str, reqs: Requests, connect: Requests, counter,
                      num_streams: int, ready, go, grpc_channels: int = 1) -> ClientReport:
    """`grpc_channels`: gRPC connections the streams take in turn (each channel its own, not
    the process's shared one), so that gateways sharing a port (SO_REUSEPORT) each get some."""
    async def timed(stream: StreamFn) -> ClientReport:
        await _streams(stream, connect, _local_taker(len(connect.prompts)), num_streams)
        tune_gc_after_startup()
        ready.put(os.getpid())
        await asyncio.get_running_loop().run_in_executor(None, go.wait)
        start_s, start_cpu_s = time.perf_counter(), time.process_time()
        traces = await _streams(stream, reqs, _shared_taker(counter, len(reqs.prompts)),
                                num_streams)
        return ClientReport(traces, num_streams, start_s, time.perf_counter(),
                            time.process_time() - start_cpu_s)

    if door == "grpc":
        options = [("grpc.use_local_subchannel_pool", 1)] if grpc_channels > 1 else []
        async with contextlib.AsyncExitStack() as channels:
            stubs = itertools.cycle([
                gateway_pb2_grpc.GenerationServiceStub(await channels.enter_async_context(
                    grpc.aio.insecure_channel(target, options=options)))
                for _ in range(grpc_channels)])
            return await timed(lambda *a: _grpc_stream(next(stubs), *a))
    limits = httpx.Limits(max_connections=num_streams, max_keepalive_connections=num_streams)
    async with httpx.AsyncClient(base_url=target, timeout=600, limits=limits) as http:
        return await timed(lambda *a: _http_stream(http, *a))


def client_process(door: str, target: str, reqs: Requests, connect: Requests, counter,
                   num_streams: int, ready, go, results, grpc_channels: int = 1) -> None:
    """A client process's body: its report, or the error that ended it, goes to `results`."""
    try:
        results.put(asyncio.run(_run_client(door, target, reqs, connect, counter, num_streams,
                                            ready, go, grpc_channels)))
    except BaseException as exc:
        results.put(RuntimeError(f"client process {os.getpid()}: {exc!r}"))
        ready.put(os.getpid())


@contextlib.contextmanager
def _bare_main():
    """spawn has each child re-import the parent's __main__ (by `__main__.__spec__.name` under
    `python -m`, else by its `__file__`): under `python -m bench.serving` that is torch and the
    engine, seconds of CPU and hundreds of MB per child, while the stack serves. A __main__ with
    neither has the child import only what unpickling its target and arguments needs."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def start_processes(procs: list[multiprocessing.process.BaseProcess]) -> None:
    """Starts spawn-context processes whose targets live in modules that import no torch."""
    with _bare_main():
        for proc in procs:
            proc.start()


class ClientProcesses:
    """K client processes for one timed run: `start()` returns once every process has connected
    (and its stack has been idle since), `run()` starts them together and merges their reports."""

    def __init__(self, door: str, target: str, reqs: Requests, connect: Requests,
                 concurrency: int, num_processes: int, start_timeout_s: float = _START_TIMEOUT_S,
                 run_timeout_s: float = _RUN_TIMEOUT_S, grpc_channels: int = 1) -> None:
        self._start_timeout_s, self._run_timeout_s = start_timeout_s, run_timeout_s
        self._ctx = multiprocessing.get_context("spawn")
        self._counter = self._ctx.Value("q", 0)
        self._ready, self._results = self._ctx.Queue(), self._ctx.Queue()
        self._go = self._ctx.Event()
        shares = split_streams(concurrency, min(num_processes, concurrency))
        offsets = [0, *itertools.accumulate(shares)]
        self._procs = [
            self._ctx.Process(target=client_process, daemon=True, args=(
                door, target, reqs,
                Requests(connect.prompts[offsets[j]:offsets[j + 1]],
                         connect.output_lens[offsets[j]:offsets[j + 1]]),
                self._counter, share, self._ready, self._go, self._results,
                min(grpc_channels, share)))
            for j, share in enumerate(shares)]

    def start(self) -> None:
        start_processes(self._procs)
        deadline = time.monotonic() + self._start_timeout_s
        for _ in self._procs:
            self._get(self._ready, "connected", self._start_timeout_s, deadline)

    def run(self) -> list[ClientReport]:
        self._go.set()
        deadline = time.monotonic() + self._run_timeout_s
        reports = [self._get(self._results, "reported its run", self._run_timeout_s, deadline)
                   for _ in self._procs]
        for proc in self._procs:
            proc.join(60)
        errors = [r for r in reports if isinstance(r, Exception)]
        if errors:
            raise errors[0]
        return reports

    def close(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
            proc.join(10)

    def _get(self, source, what: str, limit_s: float, deadline: float):
        """The next message from `source`; a clear error, and no wait past `deadline`, when a
        client process dies or hangs."""
        while True:
            try:
                return source.get(timeout=max(0.0, min(1.0, deadline - time.monotonic())))
            except queue_mod.Empty:
                dead = {p.pid: p.exitcode for p in self._procs if p.exitcode not in (None, 0)}
                if dead:
                    raise RuntimeError(f"client process died before it {what} "
                                       f"(pid: exit code {dead})") from None
                if time.monotonic() >= deadline:
                    alive = [p.pid for p in self._procs if p.is_alive()]
                    raise RuntimeError(f"client processes {alive} hung: not every one {what} "
                                       f"within {limit_s:.0f} s") from None

