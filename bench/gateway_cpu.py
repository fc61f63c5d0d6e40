"""One gateway process's CPU per streamed token, in isolation: the real gateway (`pagedserve
gateway`, both doors) in front of a stand-in scheduler whose engine is a clock
(bench.step_scheduler: every --step-ms a token for each live request, sent by the scheduler's
own SubmitStream call code), and closed-loop streaming clients in processes of their own (bench.serving_clients),
through the gRPC door and then the OpenAI HTTP door (/v1/completions, stream, usage on).

The figure is tokens per gateway CPU-second (user + system time of the gateway process over the
timed run, /proc): neither the scheduler, the worker nor the clients share that process, so on a
shared host it moves far less than wall-clock rates do. Issue #30's targets: >= 40k over gRPC,
>= 30k over HTTP.

--gateway-tree runs the gateway from another source tree (an older commit's), so that before
and after can alternate in one window (--repeats: A B, then B A, so that a drift in the host's
load falls on both) against the same scheduler, clients and workload.

    python -m bench.gateway_cpu                               # 256 streams, both doors
    python -m bench.gateway_cpu --gateway-tree /tmp/base --trees-label before after
    python -m bench.gateway_cpu --gateway-tree . --gateway-args "--num-grpc-servers 4"
    python -m bench.gateway_cpu --gateway-tree /tmp/base --gateway-args "--num-grpc-servers 4" \
        --other-gateway-args "--num-grpc-servers 4"   # both with four servers
    python -m bench.gateway_cpu --gateways 1 4 --client-processes 8 --grpc-channels 4 \
        --step-ms 2 --concurrency 1024                      # N gateways against one (#30)

--gateways N runs N gateway processes on one port (SO_REUSEPORT, as `serve
--api-server-count N`), their CPU summed; with 1 in the list too, the summary gives N gateways'
tokens per second over N times one's. The stand-in engine and the clients must offer more
than N gateways take (short steps, many streams, enough client processes and gRPC connections:
the kernel spreads connections, not streams, over the gateways), on a host with N free cores
for the gateways besides the clients'.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from pagedserve.services.rpc.internal.v1 import scheduler_pb2
from transformers import AutoTokenizer

from bench.common import DEFAULT_MODEL, finish, percentiles, quiet_logging
from bench.serving import cpu_seconds, wait_serving
from bench.serving_clients import ClientProcesses, Requests, start_processes
from bench.step_scheduler import scheduler_process
from pagedserve.supervisor import free_port

log = logging.getLogger("bench.gateway_cpu")

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"grpc": 40_000, "openai": 30_000}
# the reply: plain English, so detokenization sees ordinary pieces
REPLY_TEXT = ("The gateway turns each engine step into text for every stream it serves. It "
              "decodes the new token, checks the stop strings, and writes one event to the "
              "client, who reads it at its own pace while the next step is already running. ")


def served_model(model: str) -> tuple[scheduler_pb2.GetServedModelResponse, list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)
    info = scheduler_pb2.GetServedModelResponse(
        model=model, architecture="LlamaForCausalLM", max_model_len=8192,
        vocab_size=len(tokenizer), eos_token_ids=[tokenizer.eos_token_id],
        block_size=16, num_gpu_blocks=1 << 20, max_num_seqs=4096)
    return info, tokenizer.encode(REPLY_TEXT, add_special_tokens=False)


def start_scheduler(args: argparse.Namespace):
    info, reply_ids = served_model(args.model)
    ctx = multiprocessing.get_context("spawn")
    ports = ctx.Queue()
    proc = ctx.Process(target=scheduler_process, daemon=True,
                       args=(info.SerializeToString(), reply_ids, args.step_ms / 1e3, ports))
    start_processes([proc])
    return proc, ports.get(timeout=120), info.vocab_size


def start_gateways(args: argparse.Namespace, tree: Path, scheduler_port: int, log_file,
                   extra_flags: list[str], count: int
                   ) -> tuple[list[subprocess.Popen], str, str]:
    """`count` gateway processes on one gRPC and one HTTP port (SO_REUSEPORT when several, as
    `serve --api-server-count` starts them), each ready (its own /metrics answers) before the
    next starts."""
    port, http_port = free_port(), free_port()
    gateways: list[subprocess.Popen] = []
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(count):
            metrics_port = free_port()
            gateways.append(subprocess.Popen(
                [sys.executable, "-m", "pagedserve.cli", "gateway", "--port", str(port),
                 "--http-port", str(http_port), "--metrics-port", str(metrics_port),
                 "--scheduler-address", f"127.0.0.1:{scheduler_port}",
                 "--max-concurrent-requests", "8192", "--stream-interval",
                 str(args.stream_interval), "--http-keep-alive-timeout-s", "600",
                 "--http-header-timeout-s", "600", "--max-http-connections-per-client", "0",
                 "--log-level", "WARNING", *(["--reuse-port"] if count > 1 else []),
                 *extra_flags],
                cwd=tree, stdout=log_file, stderr=log_file,
                env={**os.environ, "PYTHONUNBUFFERED": "1"}))
            wait_metrics(gateways[-1], metrics_port, args.startup_timeout_s)
        wait_serving(address, gateways[0], args.startup_timeout_s)
    except BaseException:
        for gateway in gateways:
            gateway.kill()
        raise
    return gateways, address, f"http://127.0.0.1:{http_port}"


def wait_metrics(gateway: subprocess.Popen, metrics_port: int, timeout_s: float) -> None:
    """The gateway's /metrics starts after its gRPC server and before its HTTP server, whose
    socket it already holds: once it answers, the process takes connections on both ports."""
    deadline = time.monotonic() + timeout_s
    while True:
        if gateway.poll() is not None:
            raise RuntimeError(f"a gateway exited with code {gateway.returncode} at start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).is_success:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"a gateway's /metrics did not answer within {timeout_s:.0f} s")
        time.sleep(0.2)


def workload(args: argparse.Namespace, vocab_size: int, seed: int) -> Requests:
    rng = random.Random(seed)
    num = args.concurrency * args.requests_per_stream
    low, high = min(1000, vocab_size // 4), max(vocab_size - 1000, vocab_size * 3 // 4)
    prompts = [[rng.randrange(low, high) for _ in range(args.prompt_len)] for _ in range(num)]
    return Requests(prompts, [args.output_len] * num)


def run_door(args: argparse.Namespace, door: str, target: str, gateway_pids: list[int],
             reqs: Requests, connect: Requests) -> dict:
    clients = ClientProcesses(door, target, reqs, connect, args.concurrency,
                              args.client_processes, grpc_channels=args.grpc_channels)
    try:
        clients.start()
        time.sleep(args.settle_s)
        cpu0 = [cpu_seconds(pid) for pid in gateway_pids]
        load0, start = os.getloadavg()[0], time.perf_counter()
        reports = clients.run()
        each_cpu_s = [cpu_seconds(pid) - c for pid, c in zip(gateway_pids, cpu0, strict=True)]
        cpu_s = sum(each_cpu_s)
    finally:
        clients.close()
    wall_s = max(r.end_s for r in reports) - start
    traces = [t for r in reports for t in r.traces]
    num_tokens = sum(t.num_tokens for t in traces)
    return {"door": door, "num_gateways": len(gateway_pids), "num_requests": len(traces),
            "num_output_tokens": num_tokens, "wall_s": wall_s,
            "output_tok_s": num_tokens / wall_s, "gateway_cpu_s": cpu_s,
            "each_gateway_cpu_s": each_cpu_s,
            "gateway_busy": cpu_s / wall_s, "gateway_us_per_token": 1e6 * cpu_s / num_tokens,
            "gateway_tok_per_cpu_s": num_tokens / cpu_s,
            # the events with text a client read: more than one token each where the gateway
            # (or the scheduler's response window) merged steps
            "tokens_per_event": num_tokens / sum(len(t.chunk_times_s) for t in traces),
            "ttft_ms": percentiles([(t.chunk_times_s[0] - t.submit_s) * 1e3 for t in traces]),
            "clients_cpu_s": sum(r.cpu_s for r in reports),
            "max_client_busy": max(r.busy for r in reports), "load_average_1m": load0}


def run_tree(args: argparse.Namespace, label: str, tree: Path, extra_flags: list[str],
             scheduler_port: int, vocab_size: int, round_index: int, log_file,
             num_gateways: int = 1) -> list[dict]:
    gateways, address, base_url = start_gateways(args, tree, scheduler_port, log_file,
                                                 extra_flags, num_gateways)
    try:
        results = []
        for door in args.doors:
            target = address if door == "grpc" else base_url
            connect = Requests([[7] * 4] * args.concurrency, [1] * args.concurrency)
            reqs = workload(args, vocab_size, args.seed + round_index)
            result = run_door(args, door, target, [g.pid for g in gateways], reqs, connect)
            results.append({"tree": label, "round": round_index, **result})
            log.info("%s round %d %s: %.1f us per token, %.0f tok per CPU-s, %.0f tok/s, "
                     "%.2f tokens per event, gateway busy %.2f, load %.1f", label, round_index,
                     door, result["gateway_us_per_token"], result["gateway_tok_per_cpu_s"],
                     result["output_tok_s"], result["tokens_per_event"], result["gateway_busy"],
                     result["load_average_1m"])
        return results
    finally:
        for gateway in gateways:
            gateway.terminate()
        for gateway in gateways:
            try:
                gateway.wait(30)
            except subprocess.TimeoutExpired:
                gateway.kill()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the served folder: tokenizer")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--step-ms", type=float, default=20.0,
                        help="the stand-in engine's step: one token per live request each")
    parser.add_argument("--stream-interval", type=int, default=1)
    parser.add_argument("--doors", nargs="+", choices=("grpc", "openai"),
                        default=["grpc", "openai"])
    parser.add_argument("--client-processes", type=int, default=1)
    parser.add_argument("--grpc-channels", type=int, default=1,
                        help="gRPC connections per client process (several gateways on one "
                             "port share connections, not streams)")
    parser.add_argument("--gateways", type=int, nargs="+", default=[1],
                        help="gateway processes on one port, each count in turn (1 4: how 4 "
                             "scale against 1; issue #30: >= 0.8 x N on N free cores)")
    parser.add_argument("--settle-s", type=float, default=1.0)
    parser.add_argument("--gateway-tree", type=Path, default=None,
                        help="a second source tree whose gateway alternates with this one's")
    parser.add_argument("--trees-label", nargs=2, default=["other", "this"],
                        help="names of --gateway-tree and of this tree in the record")
    parser.add_argument("--gateway-args", default="",
                        help="extra flags for this tree's gateway, not --gateway-tree's")
    parser.add_argument("--other-gateway-args", default="",
                        help="extra flags for --gateway-tree's gateway")
    parser.add_argument("--repeats", type=int, default=1, help="rounds (A B, then B A, ...)")
    parser.add_argument("--startup-timeout-s", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    trees = [(args.trees_label[1], ROOT, args.gateway_args.split())]
    if args.gateway_tree is not None:
        trees.insert(0, (args.trees_label[0], args.gateway_tree.resolve(),
                         args.other_gateway_args.split()))
    load_before = os.getloadavg()[0]
    scheduler, scheduler_port, vocab_size = start_scheduler(args)
    results: list[dict] = []
    with tempfile.TemporaryFile("w+") as log_file:
        try:
            for round_index in range(args.repeats):
                forward = round_index % 2 == 0
                for label, tree, flags in trees if forward else trees[::-1]:
                    for count in args.gateways if forward else args.gateways[::-1]:
                        results += run_tree(args, label, tree, flags, scheduler_port,
                                            vocab_size, round_index, log_file, count)
        except Exception:
            log_file.seek(0)
            log.error("gateway log:\n%s", log_file.read()[-4000:])
            raise
        finally:
            scheduler.kill()
            scheduler.join(10)
    summary = summarize(args, [label for label, _, _ in trees], results)
    line = (f"gateway CPU per streamed token, {args.concurrency} streams, step "
            f"{args.step_ms:g} ms, stream interval {args.stream_interval}: " + "; ".join(
                f"{key} {s['median_tok_per_cpu_s'] / 1e3:.1f}k tok per CPU-s "
                f"({', '.join(f'{u:.1f}' for u in s['gateway_us_per_token'])} us/token; target "
                f"{s['target_tok_per_cpu_s'] / 1e3:.0f}k)"
                + (f", {s['scaling']:.2f} of {s['num_gateways']}x one gateway's tok/s"
                   if "scaling" in s else "") for key, s in summary.items()))
    return finish("gateway_cpu", args, line, results, medians=summary,
                  load_average_before=load_before, load_average_after=os.getloadavg()[0])


def summarize(args: argparse.Namespace, labels: list[str], results: list[dict]) -> dict:
    """Medians by tree, door and gateway count; where one gateway ran too, N gateways' tok/s
    over N times one's (the scaling)."""
    summary: dict[str, dict] = {}
    for label in labels:
        for door in args.doors:
            one_tok_s = None
            for count in sorted(args.gateways):
                runs = [r for r in results if r["tree"] == label and r["door"] == door
                        and r["num_gateways"] == count]
                us = sorted(r["gateway_us_per_token"] for r in runs)
                tok_s = statistics.median(r["output_tok_s"] for r in runs)
                entry = {"num_gateways": count, "gateway_us_per_token": us,
                         "median_tok_per_cpu_s": 1e6 / us[len(us) // 2],
                         "median_output_tok_s": tok_s, "target_tok_per_cpu_s": TARGETS[door]}
                if count == 1:
                    one_tok_s = tok_s
                elif one_tok_s is not None:
                    entry["scaling"] = tok_s / (count * one_tok_s)
                key = f"{label}/{door}" + (f"/{count}gw" if len(args.gateways) > 1 else "")
                summary[key] = entry
    return summary


if __name__ == "__main__":
    main()
