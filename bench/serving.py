"""Serving: N concurrent streaming clients through the gateway of the local stack, against the
in-process engine on the same workload, same run.

The stack is `python -m pagedserve.cli serve` (worker, scheduler and gateway as processes, gRPC
over loopback). Each of N clients sends its requests one after another (closed loop) through
GenerationService.GenerateStream with token-id prompts, greedy and ignore_eos; the in-process
baseline drives LLMEngine the same way, keeping N requests in flight. For each N: time to first
token and inter-token latency percentiles (ms), output tokens/s, and stack ÷ in-process throughput
(target >= 0.9). The record goes to bench/results/serving-<tag>.json.

`--api openai` also runs the same closed-loop workload through the gateway's OpenAI-compatible
HTTP API (/v1/completions, token-id prompts, SSE) and reports it against the gRPC door of the
same stack in the same run (target: >= 0.9x throughput, TTFT p50 within 10%).

Each timed run through the stack starts alike for both doors: its client (a gRPC channel, an
httpx pool) is made and connected by N one-token requests, the stack is left idle for
`--settle-s`, and only then do the N clients start. Before, the client was made inside the run:
the httpx client (its SSL context alone ~18 ms of CPU) and its N TCP connections put the HTTP
burst of N first requests 20-30 ms behind gRPC's (one HTTP/2 connection), and each burst met
whatever the previous run had left in the scheduler (async scheduling keeps a step in flight
after the last request ends, and batches what arrives before that step ends; an idle scheduler
prefills the first arrival alone). At N = 8 the p50 of 16 TTFTs was a TTFT of that burst, so it
measured how each burst met the scheduler, not the door. With 4 requests per client (the
default; it was 2) the p50 falls among requests that join a running batch.

    python -m bench.serving                          # N = 1, 8, 32
    python -m bench.serving --concurrency 1 4 --requests-per-client 1 --tag smoke
    python -m bench.serving --api openai --concurrency 8 --tag openai
    python -m bench.serving --device cuda --shape smollm2-1.7b --api openai --concurrency 1 32 256

`--device cuda` runs both sides on one GPU, each with its own --gpu-memory-utilization share;
`--shape` serves a model of that shape (bench/offline_gpu.py's configs) with random weights.
`--device sim` runs both sides on the simulated worker (`--sim-model` on `--sim-gpu`, its step
time from `--sim-step-model`): the doors at GPU speed on a CPU machine; its figures are models.

    python -m bench.serving --device sim --api openai --concurrency 1 32 256 1024 --tag sim

The clients are the load generator, and it must not bound what it measures: one Python process
streaming to 256 clients used ~0.9 (gRPC) to 1 (HTTP) core on the H100 run. They run in
`--client-processes` K processes (default: one per 32 streams, on at most half the cores), each
with its own event loop and its own channel or HTTP client, all taking prompts from one shared
counter: the closed loop and the request count are those of one process. Each process connects
first (the warm-up above, for its own streams) and they start together. A client process imports
neither torch nor this module (docs/performance.md, the load generator: K = 4 ready in ~3 s
rather than ~22 s on the 2-core dev host), and a dead or hung one fails the run.

Each timed run through the stack records the CPU seconds of the gateway, scheduler and worker
processes (/proc/<pid>/stat, every thread) and of the client processes (summed as `clients`, and
each process's CPU seconds and busy fraction under `client_processes`), and each per streamed
output token (`cpu_us_per_token`), with the gateway's tokens per CPU-second: on a shared host
wall-clock rates move with the neighbours' load, CPU per token much less. A client process busier
than 0.8 of a core sets `is_client_saturated` and is named in the result line: that run may have
measured its load generator.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import logging
import os
import subprocess
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.services.common.gc_tuning import tune_gc_after_startup

from bench.common import (
    DEFAULT_MODEL,
    Workload,
    finish,
    make_workload,
    percentiles,
    quiet_logging,
    serve_process,
)
from bench.offline_gpu import MODEL_CONFIGS, write_model_dir
from bench.serving_clients import (
    SATURATED_BUSY,
    ClientProcesses,
    ClientReport,
    Requests,
    RequestTrace,
    default_client_processes,
)
from pagedserve.llm_engine import LLMEngine
from pagedserve.supervisor import free_port

log = logging.getLogger("bench.serving")

ROOT = Path(__file__).resolve().parents[1]
TARGET_RATIO = 0.9
MAX_TTFT_INCREASE = 0.1  # the HTTP door's TTFT p50 within 10% of gRPC's
_CLK_TCK = os.sysconf("SC_CLK_TCK")
SERVICES = ("gateway", "scheduler", "worker")


@dataclass(slots=True)
class RunResult:
    wall_s: float
    traces: list[RequestTrace]
    cpu_s: dict[str, float] | None = None  # per process role, over the timed run
    clients: list[ClientReport] = field(default_factory=list)

    def summary(self) -> dict:
        ttft_ms = [(t.chunk_times_s[0] - t.submit_s) * 1e3 for t in self.traces]
        itl_ms = [(b - a) * 1e3 for t in self.traces
                  for a, b in itertools.pairwise(t.chunk_times_s)]
        num_tokens = sum(t.num_tokens for t in self.traces)
        out = {"wall_s": self.wall_s, "num_output_tokens": num_tokens,
               "output_tok_s": num_tokens / self.wall_s, "ttft_ms": percentiles(ttft_ms),
               "itl_ms": percentiles(itl_ms),
               "num_messages": sum(len(t.chunk_times_s) for t in self.traces)}
        if self.cpu_s is not None:
            out["cpu_s"] = self.cpu_s
            out["cpu_us_per_token"] = {name: 1e6 * s / num_tokens
                                       for name, s in self.cpu_s.items()}
            gateway_s = self.cpu_s.get("gateway")
            out["gateway_tok_per_cpu_s"] = num_tokens / gateway_s if gateway_s else None
        if self.clients:
            out["client_processes"] = [
                {"num_streams": c.num_streams, "num_requests": len(c.traces), "cpu_s": c.cpu_s,
                 "busy": c.busy} for c in self.clients]
            out["max_client_busy"] = max(c.busy for c in self.clients)
            out["is_client_saturated"] = out["max_client_busy"] > SATURATED_BUSY
        return out


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def child_pids(pid: int) -> list[int]:
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        children += [int(c) for c in (task / "children").read_text().split()]
    return children


def service_pids(stack_pid: int) -> dict[str, list[int]]:
    """The `serve` supervisor's children by role (their `pagedserve.cli <role>` command line)."""
    pids: dict[str, list[int]] = {role: [] for role in SERVICES}
    for pid in child_pids(stack_pid):
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        for role in SERVICES:
            if role.encode() in argv[:4]:
                pids[role].append(pid)
    return pids


class CpuMeter:
    """CPU seconds of each role's processes (summed); the client processes time their own."""

    def __init__(self, stack_pid: int | None) -> None:
        self._pids = service_pids(stack_pid) if stack_pid is not None else {}

    def read(self) -> dict[str, float]:
        return {role: sum(cpu_seconds(pid) for pid in pids) for role, pids in self._pids.items()}

    def since(self, before: dict[str, float]) -> dict[str, float]:
        now = self.read()
        return {name: now[name] - before[name] for name in before}


# --- the in-process baseline ----------------------------------------------------------------------


def run_in_process(engine: LLMEngine, wl: Workload, concurrency: int) -> RunResult:
    """Closed loop: N requests in flight, the next one added as soon as one finishes."""
    params = wl.sampling_params()
    pending = deque(range(len(wl.prompts)))
    traces: dict[str, RequestTrace] = {}
    live: set[str] = set()
    start = time.perf_counter()
    while pending or live:
        while pending and len(live) < concurrency:
            i = pending.popleft()
            request_id = f"{wl.name}-{concurrency}-{i}"
            traces[request_id] = RequestTrace(time.perf_counter())
            engine.add_request(request_id, wl.prompts[i], params[i])
            live.add(request_id)
        outputs = engine.step()
        now = time.perf_counter()
        for output in outputs:
            trace = traces[output.request_id]
            num_new = sum(len(c.token_ids) for c in output.outputs)
            if num_new:
                trace.chunk_times_s.append(now)
                trace.num_tokens += num_new
            if output.finished:
                live.discard(output.request_id)
    return RunResult(time.perf_counter() - start, list(traces.values()))


# --- the stack ----------------------------------------------------------------------------------


def engine_kwargs(args: argparse.Namespace) -> dict:
    """One configuration for both sides. On CUDA they share the device: each takes its own
    --gpu-memory-utilization of it."""
    kwargs = dict(model=args.model, tokenizer=args.tokenizer, load_format=args.load_format,
                  device=args.device, dtype=args.dtype, max_num_seqs=max(args.concurrency),
                  swap_space_gib=0.25)
    if args.device == "cuda":
        kwargs["gpu_memory_utilization"] = args.gpu_memory_utilization
    elif args.device == "sim":
        kwargs.update(sim_model=args.sim_model, sim_gpu=args.sim_gpu,
                      sim_step_model=args.sim_step_model, seed=args.seed)
    else:
        kwargs["kv_cache_memory_gib"] = args.kv_cache_memory_gib
    return kwargs


def serve_args(args: argparse.Namespace, port: int, http_port: int) -> list[str]:
    flags = [arg for name, value in engine_kwargs(args).items() if value != ""
             for arg in (f"--{name.replace('_', '-')}", str(value))]
    return ["--port", str(port), "--http-port", str(http_port), *flags,
            "--stream-interval", str(args.stream_interval),
            "--api-server-count", str(args.api_server_count),
            # N connections opened at once by one client: a loaded gateway must not close them
            # as idle or slow before their turn (at N = 1024 the defaults did)
            "--http-keep-alive-timeout-s", "600", "--http-header-timeout-s", "600",
            "--max-http-connections-per-client", "0", "--log-level", "WARNING"]


def wait_serving(address: str, stack: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if stack.poll() is not None:
                raise RuntimeError(f"the stack exited with code {stack.returncode}")
            try:
                status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.5)  # the children start in seconds; a coarse poll is fine here
    raise TimeoutError(f"the stack at {address} did not serve within {timeout_s:.0f} s")


def run_clients(door: str, target: str, wl: Workload, concurrency: int, connect: Workload,
                num_processes: int, settle_s: float = 0.0,
                meter: CpuMeter | None = None) -> RunResult:
    """N closed-loop clients in `num_processes` processes through one door (`grpc`: address,
    `openai`: base URL). Every process connects first (`connect`, one one-token request per
    stream: its connections open, N of them over HTTP/1.1), then `settle_s` of quiet (the
    stack's last speculative step has ended), and only then the timed run: each door's burst of
    N first requests meets an idle scheduler."""
    clients = ClientProcesses(door, target, Requests(wl.prompts, wl.output_lens),
                              Requests(connect.prompts, connect.output_lens), concurrency,
                              num_processes)
    try:
        clients.start()
        time.sleep(settle_s)
        before = meter.read() if meter is not None else None
        start = time.perf_counter()
        reports = clients.run()
    finally:
        clients.close()
    result = RunResult(max(r.end_s for r in reports) - start,
                       [t for r in reports for t in r.traces], clients=reports)
    if meter is not None:
        result.cpu_s = {**meter.since(before), "clients": sum(r.cpu_s for r in reports)}
    return result


def openai_vs_grpc(openai: dict, grpc_door: dict) -> dict:
    throughput = openai["output_tok_s"] / grpc_door["output_tok_s"]
    ttft = openai["ttft_ms"]["p50"] / grpc_door["ttft_ms"]["p50"]
    return {"throughput_ratio": throughput, "ttft_p50_ratio": ttft,
            "met": throughput >= TARGET_RATIO and ttft <= 1 + MAX_TTFT_INCREASE}


# --- main ---------------------------------------------------------------------------------------


def run_all(args: argparse.Namespace, address: str, stack: subprocess.Popen,
            http_url: str | None = None) -> list[dict]:
    # once the stack has its memory: on a shared GPU, the engine's profile then sees it settled
    wait_serving(address, stack, args.startup_timeout_s)
    engine = LLMEngine.from_kwargs(**{k: v for k, v in engine_kwargs(args).items() if v != ""})
    vocab = engine.core.vocab_size
    warm = make_workload("warmup", 2, (16, 32), (8, 8), vocab, seed=args.seed + 1)
    run_in_process(engine, warm, 2)
    # as the services do: a full collection over the engine took ~0.2 s of CPU in this process
    tune_gc_after_startup()
    run_clients("grpc", address, warm, 2, warm, 1)
    if http_url is not None:
        run_clients("openai", http_url, warm, 2, warm, 1)
    meter = CpuMeter(stack.pid)
    results = []
    for concurrency in args.concurrency:
        num_requests = max(args.min_requests, args.requests_per_client * concurrency)
        wl = make_workload(f"n{concurrency}", num_requests,
                           (args.min_prompt_len, args.max_prompt_len),
                           (args.min_output_len, args.max_output_len), vocab,
                           seed=args.seed + concurrency)
        connect = make_workload(f"connect{concurrency}", concurrency, (8, 8), (1, 1), vocab,
                                seed=args.seed + concurrency + 1)
        num_processes = args.client_processes or default_client_processes(
            concurrency, len(os.sched_getaffinity(0)))
        # back to back, in alternating order, so that neither side always runs second
        runs = {"in_process": functools.partial(run_in_process, engine, wl, concurrency),
                "stack": functools.partial(run_clients, "grpc", address, wl, concurrency,
                                           connect, num_processes, args.settle_s, meter)}
        if http_url is not None:
            runs["openai"] = functools.partial(run_clients, "openai", http_url, wl, concurrency,
                                               connect, num_processes, args.settle_s, meter)
        order = list(runs) if len(results) % 2 == 0 else list(reversed(runs))
        summaries = {name: runs[name]().summary() for name in order}
        in_process, served = summaries["in_process"], summaries["stack"]
        log.info("N=%d: in-process %.1f tok/s, stack %.1f tok/s", concurrency,
                 in_process["output_tok_s"], served["output_tok_s"])
        ratio = served["output_tok_s"] / in_process["output_tok_s"]
        results.append({**wl.describe(), "concurrency": concurrency, "stack": served,
                        "in_process": in_process, "ratio_vs_in_process": ratio,
                        "target": {"target": TARGET_RATIO, "met": ratio >= TARGET_RATIO}})
        if http_url is not None:
            results[-1]["openai"] = summaries["openai"]
            results[-1]["openai_vs_grpc"] = openai_vs_grpc(summaries["openai"], served)
    gc.unfreeze()  # the engine is freed at exit as before (nanobind reports what is not)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--settle-s", type=float, default=1.0,
                        help="idle time before each timed run through the stack, once its "
                             "client is connected")
    parser.add_argument("--min-requests", type=int, default=4,
                        help="at least this many requests per concurrency level")
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--min-output-len", type=int, default=32)
    parser.add_argument("--max-output-len", type=int, default=96)
    parser.add_argument("--device", choices=["cpu", "cuda", "sim"], default="cpu")
    parser.add_argument("--sim-model", default="SmolLM2-1.7B",
                        help="device sim: the preset whose step time is modelled")
    parser.add_argument("--sim-gpu", default="H100-SXM", help="device sim: the modelled GPU")
    parser.add_argument("--sim-step-model", choices=["kernels", "roofline"], default="kernels",
                        help="device sim: the calibrated kernel trace, or the roofline bound")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the gateway's: output tokens per streamed message")
    parser.add_argument("--api-server-count", type=int, default=1,
                        help="gateway processes on the stack's ports (their CPU is summed)")
    parser.add_argument("--client-processes", type=int, default=0,
                        help="processes the N clients are spread over, each with its own "
                             "channel or HTTP client; 0: one per 32 streams on at most half the "
                             "cores")
    parser.add_argument("--note", default="",
                        help="recorded beside the results (e.g. what else ran on the host)")
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                        help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--shape", choices=sorted(MODEL_CONFIGS), default=None,
                        help="instead of --model: this model's shape with random weights "
                             "(load_format dummy) and --tokenizer's tokenizer")
    parser.add_argument("--tokenizer", default="",
                        help="tokenizer folder; default: the model's, or with --shape the "
                             "default model's (SmolLM2's)")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=1.0, help="CPU")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.4,
                        help="CUDA: the share of the device each side (stack, in-process) takes")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    parser.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                        help="openai: also the OpenAI-compatible HTTP door, against gRPC")
    args = parser.parse_args(argv)
    if args.client_processes < 0:
        parser.error(f"--client-processes must be >= 0, got {args.client_processes}")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.load_format = "dummy" if args.shape else "auto"
    if args.shape and not args.tokenizer:
        args.tokenizer = DEFAULT_MODEL
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    port = free_port()
    address = f"127.0.0.1:{port}"
    http_port = free_port() if args.api == "openai" else 0
    http_url = f"http://127.0.0.1:{http_port}" if http_port else None
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        if args.shape:
            args.model = str(write_model_dir(args.shape, args.dtype, Path(tmp)))
        with serve_process(serve_args(args, port, http_port), ROOT) as stack:
            results = run_all(args, address, stack, http_url)
    model = f"{args.shape} shape, dummy weights" if args.shape else args.model
    if args.device == "sim":
        model = (f"simulated {args.sim_model} on {args.sim_gpu} ({args.sim_step_model} step "
                 f"model; figures are models, not measurements), tokenizer {args.model}")

    line = "serving: " + "; ".join(
        f"N={r['concurrency']} {r['stack']['output_tok_s']:.1f} tok/s "
        f"TTFT p50 {r['stack']['ttft_ms']['p50']:.0f} ms, ITL p50 {r['stack']['itl_ms']['p50']:.0f}"
        f"/p99 {r['stack']['itl_ms']['p99']:.0f} ms, {r['ratio_vs_in_process']:.2f}x in-process"
        f"{'' if r['target']['met'] else ' (target 0.9x MISSED)'}"
        + (f"; openai {r['openai']['output_tok_s']:.1f} tok/s "
           f"{r['openai_vs_grpc']['throughput_ratio']:.2f}x gRPC, TTFT p50 "
           f"{r['openai_vs_grpc']['ttft_p50_ratio']:.2f}x"
           f"{'' if r['openai_vs_grpc']['met'] else ' (target MISSED)'}" if "openai" in r else "")
        + "; gateway tok per CPU-s " + ", ".join(
            f"{door} {r[door]['gateway_tok_per_cpu_s']:.0f}" for door in ("stack", "openai")
            if r.get(door, {}).get("gateway_tok_per_cpu_s"))
        + "".join(f"; {door} client process SATURATED ({r[door]['max_client_busy']:.0%} of a "
                  f"core: the load generator may have bounded this run)"
                  for door in ("stack", "openai") if r.get(door, {}).get("is_client_saturated"))
        for r in results)
    return finish("serving", args, line, results, model=model, dtype=args.dtype,
                  note=args.note)


if __name__ == "__main__":
    main()
