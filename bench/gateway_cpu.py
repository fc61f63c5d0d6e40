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
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


def start_gateway(args: argparse.Namespace, tree: Path, scheduler_port: int, log_file,
                  extra_flags: list[str]) -> tuple[subprocess.Popen, str, str]:
    port, http_port = free_port(), free_port()
    gateway = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "gateway", "--port", str(port),
         "--http-port", str(http_port), "--scheduler-address", f"127.0.0.1:{scheduler_port}",
         "--max-concurrent-requests", "8192", "--stream-interval", str(args.stream_interval),
         "--http-keep-alive-timeout-s", "600", "--http-header-timeout-s", "600",
         "--max-http-connections-per-client", "0", "--log-level", "WARNING", *extra_flags],
        cwd=tree, stdout=log_file, stderr=log_file, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, gateway, args.startup_timeout_s)
    except BaseException:
        gateway.kill()
        raise
    return gateway, address, f"http://127.0.0.1:{http_port}"


def workload(args: argparse.Namespace, vocab_size: int, seed: int) -> Requests:
    rng = random.Random(seed)
    num = args.concurrency * args.requests_per_stream
    prompts = [[rng.randrange(1000, vocab_size - 1000) for _ in range(args.prompt_len)]
               for _ in range(num)]
    return Requests(prompts, [args.output_len] * num)


def run_door(args: argparse.Namespace, door: str, target: str, gateway_pid: int,
             reqs: Requests, connect: Requests) -> dict:
    clients = ClientProcesses(door, target, reqs, connect, args.concurrency,
                              args.client_processes)
    try:
        clients.start()
        time.sleep(args.settle_s)
        cpu0, load0, start = cpu_seconds(gateway_pid), os.getloadavg()[0], time.perf_counter()
        reports = clients.run()
        cpu_s = cpu_seconds(gateway_pid) - cpu0
    finally:
        clients.close()
    wall_s = max(r.end_s for r in reports) - start
    traces = [t for r in reports for t in r.traces]
    num_tokens = sum(t.num_tokens for t in traces)
    return {"door": door, "num_requests": len(traces), "num_output_tokens": num_tokens,
            "wall_s": wall_s, "output_tok_s": num_tokens / wall_s, "gateway_cpu_s": cpu_s,
            "gateway_busy": cpu_s / wall_s, "gateway_us_per_token": 1e6 * cpu_s / num_tokens,
            "gateway_tok_per_cpu_s": num_tokens / cpu_s,
            # the events with text a client read: more than one token each where the gateway
            # (or the scheduler's response window) merged steps
            "tokens_per_event": num_tokens / sum(len(t.chunk_times_s) for t in traces),
            "ttft_ms": percentiles([(t.chunk_times_s[0] - t.submit_s) * 1e3 for t in traces]),
            "clients_cpu_s": sum(r.cpu_s for r in reports),
            "max_client_busy": max(r.busy for r in reports), "load_average_1m": load0}


def run_tree(args: argparse.Namespace, label: str, tree: Path, extra_flags: list[str],
             scheduler_port: int, vocab_size: int, round_index: int, log_file) -> list[dict]:
    gateway, address, base_url = start_gateway(args, tree, scheduler_port, log_file,
                                               extra_flags)
    try:
        results = []
        for door in args.doors:
            target = address if door == "grpc" else base_url
            connect = Requests([[7] * 4] * args.concurrency, [1] * args.concurrency)
            reqs = workload(args, vocab_size, args.seed + round_index)
            result = run_door(args, door, target, gateway.pid, reqs, connect)
            results.append({"tree": label, "round": round_index, **result})
            log.info("%s round %d %s: %.1f us per token, %.0f tok per CPU-s, %.0f tok/s, "
                     "%.2f tokens per event, gateway busy %.2f, load %.1f", label, round_index,
                     door, result["gateway_us_per_token"], result["gateway_tok_per_cpu_s"],
                     result["output_tok_s"], result["tokens_per_event"], result["gateway_busy"],
                     result["load_average_1m"])
        return results
    finally:
        gateway.terminate()
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
                for label, tree, flags in trees if round_index % 2 == 0 else trees[::-1]:
                    results += run_tree(args, label, tree, flags, scheduler_port, vocab_size,
                                        round_index, log_file)
        except Exception:
            log_file.seek(0)
            log.error("gateway log:\n%s", log_file.read()[-4000:])
            raise
        finally:
            scheduler.kill()
            scheduler.join(10)
    summary = {}
    for label, _, _ in trees:
        for door in args.doors:
            runs = [r for r in results if r["tree"] == label and r["door"] == door]
            us = sorted(r["gateway_us_per_token"] for r in runs)
            summary[f"{label}/{door}"] = {
                "gateway_us_per_token": us, "median_tok_per_cpu_s": 1e6 / us[len(us) // 2],
                "target_tok_per_cpu_s": TARGETS[door]}
    line = (f"gateway CPU per streamed token, {args.concurrency} streams, step "
            f"{args.step_ms:g} ms, stream interval {args.stream_interval}: " + "; ".join(
                f"{key} {s['median_tok_per_cpu_s'] / 1e3:.1f}k tok per CPU-s "
                f"({', '.join(f'{u:.1f}' for u in s['gateway_us_per_token'])} us/token; target "
                f"{s['target_tok_per_cpu_s'] / 1e3:.0f}k)" for key, s in summary.items()))
    return finish("gateway_cpu", args, line, results, summary=summary,
                  load_average_before=load_before, load_average_after=os.getloadavg()[0])


if __name__ == "__main__":
    main()
