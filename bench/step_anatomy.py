"""Step anatomy: where one engine step's time goes, at decode batch 1 and 32, with the worker
in process and behind gRPC (a `services.cli worker` process on loopback), same run.

Per decode-only step with exactly B sequences, medians in ms of:
  schedule     Scheduler.schedule() (the plan, block tables, deltas)
  rpc          ExecuteStep round trip minus the worker's own time: protobuf conversion both
               ways, serialization, loopback transport, the servicer (0 in process, by
               construction: the in-process figure is the call overhead alone)
  cache_ops    swap/copy blocks on the worker
  prepare      mirror deltas + the flattened batch (input ids, positions, slot mapping, ...)
  forward      the model, logits at the sampled rows
  sample       the sampler
  output       OutputProcessor.process (append tokens, stop checks, free blocks, reports)
  other        the rest of EngineCore.step
Target: schedule + rpc + output + other <= 1 ms at B = 32 through gRPC.
The record goes to bench/results/step_anatomy-<tag>.json.

    python -m bench.step_anatomy
    python -m bench.step_anatomy --batch-sizes 1 4 --output-len 8 --tag smoke
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import DEFAULT_MODEL, finish, make_workload, quiet_logging
from scheduler_svc.engine_core import EngineCore, WorkerLike
from services.llm_engine import engine_config_from_kwargs
from services.step_plan import StepOutput, StepPlan
from services.supervisor import free_port
from worker_svc.client import GrpcWorker
from worker_svc.convert import step_plan_to_proto
from worker_svc.worker import Worker

log = logging.getLogger("bench.step_anatomy")

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("schedule", "rpc", "cache_ops", "prepare", "forward", "sample", "output", "other")
OVERHEAD_PHASES = ("schedule", "rpc", "output", "other")
TARGET_OVERHEAD_MS = 1.0


class StepRecorder:
    """Wraps the engine's scheduler, output processor and worker call on the instance, so each
    step's phases are timed without touching the engine's code."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.current: dict[str, Any] = {}
        core.scheduler.schedule = self._timed(core.scheduler.schedule, "schedule_ns")
        core.output_processor.process = self._timed(core.output_processor.process, "output_ns")
        worker = core.workers[0]
        execute_step = worker.execute_step

        def timed_execute(plan: StepPlan) -> StepOutput:
            start = time.perf_counter_ns()
            output = execute_step(plan)
            self.current.update(call_ns=time.perf_counter_ns() - start, plan=plan,
                                timings=output.timings)
            return output

        worker.execute_step = timed_execute

    def _timed(self, fn: Callable, key: str) -> Callable:
        def timed(*args: Any) -> Any:
            start = time.perf_counter_ns()
            result = fn(*args)
            self.current[key] = time.perf_counter_ns() - start
            return result
        return timed

    def step(self) -> dict[str, Any]:
        self.current = {}
        start = time.perf_counter_ns()
        self.core.step()
        self.current["step_ns"] = time.perf_counter_ns() - start
        return self.current


def phases_ms(record: dict[str, Any]) -> dict[str, float]:
    t = record["timings"]
    worker_ns = t.cache_ops_ns + t.prepare_ns + t.forward_ns + t.sample_ns
    ns = {"schedule": record["schedule_ns"], "rpc": record["call_ns"] - worker_ns,
          "cache_ops": t.cache_ops_ns, "prepare": t.prepare_ns, "forward": t.forward_ns,
          "sample": t.sample_ns, "output": record["output_ns"]}
    ns["other"] = record["step_ns"] - sum(ns.values())
    return {name: value / 1e6 for name, value in ns.items()}


def is_decode_step(plan: StepPlan, batch_size: int) -> bool:
    return (not plan.new_seqs and len(plan.running_seqs) == batch_size
            and all(s.num_scheduled_tokens == 1 for s in plan.running_seqs))


def measure(core: EngineCore, batch_size: int, args: argparse.Namespace) -> dict:
    recorder = StepRecorder(core)
    wl = make_workload(f"b{batch_size}", batch_size, (args.prompt_len,) * 2,
                       (args.output_len,) * 2, core.vocab_size, seed=args.seed)
    for i, (prompt, sampling) in enumerate(zip(wl.prompts, wl.sampling_params(), strict=True)):
        core.add_request(f"b{batch_size}-{i}", prompt, sampling)
    samples, request_bytes = [], []
    while core.has_unfinished_requests():
        record = recorder.step()
        if "plan" in record and is_decode_step(record["plan"], batch_size):
            samples.append(phases_ms(record))
            request_bytes.append(step_plan_to_proto(record["plan"]).ByteSize())
    samples = samples[args.skip_steps:]
    if not samples:
        raise RuntimeError(f"no decode step ran at batch {batch_size}")
    median = {name: statistics.median(s[name] for s in samples) for name in PHASES}
    median["total"] = statistics.median(sum(s.values()) for s in samples)
    overhead = statistics.median(sum(s[n] for n in OVERHEAD_PHASES) for s in samples)
    return {"batch_size": batch_size, "num_steps": len(samples), "median_ms": median,
            "p90_ms": {name: sorted(s[name] for s in samples)[int(0.9 * (len(samples) - 1))]
                       for name in PHASES},
            "scheduler_plus_rpc_ms": overhead,
            "step_request_bytes": statistics.median(request_bytes)}


def start_worker(args: argparse.Namespace, port: int, log_file) -> subprocess.Popen:
    argv = [sys.executable, "-m", "services.cli", "worker", *engine_argv(args),
            "--port", str(port), "--log-level", "WARNING"]
    return subprocess.Popen(argv, cwd=ROOT, stdout=log_file, stderr=log_file,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def engine_argv(args: argparse.Namespace) -> list[str]:
    return ["--model", args.model, "--device", "cpu", "--dtype", "float32",
            "--max-num-seqs", str(max(args.batch_sizes)), "--kv-cache-memory-gib", "0.5",
            "--swap-space-gib", "0.1"]


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"model": args.model, "device": "cpu", "dtype": "float32",
            "max_num_seqs": max(args.batch_sizes), "kv_cache_memory_gib": 0.5,
            "swap_space_gib": 0.1}


def run_mode(mode: str, workers: list[WorkerLike], args: argparse.Namespace) -> list[dict]:
    config = engine_config_from_kwargs(**engine_kwargs(args))
    core = EngineCore(config, workers)
    warm = make_workload("warmup", 2, (16, 16), (4, 4), core.vocab_size, seed=args.seed + 1)
    for i, (prompt, sampling) in enumerate(zip(warm.prompts, warm.sampling_params(),
                                               strict=True)):
        core.add_request(f"warmup-{i}", prompt, sampling)
    while core.has_unfinished_requests():
        core.step()
    results = []
    for batch_size in args.batch_sizes:
        result = {"mode": mode, **measure(core, batch_size, args)}
        log.info("%s B=%d: %s", mode, batch_size,
                 ", ".join(f"{k} {v:.2f}" for k, v in result["median_ms"].items()))
        results.append(result)
    return results


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--skip-steps", type=int, default=2, help="decode steps not counted")
    parser.add_argument("--modes", nargs="+", default=["in_process", "grpc"],
                        choices=["in_process", "grpc"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    results = []
    if "in_process" in args.modes:
        config = engine_config_from_kwargs(**engine_kwargs(args))
        results += run_mode("in_process", [Worker(config)], args)
    if "grpc" in args.modes:
        port = free_port()
        with tempfile.TemporaryFile("w+") as worker_log:
            worker = start_worker(args, port, worker_log)
            try:
                config = engine_config_from_kwargs(**engine_kwargs(args))
                client = GrpcWorker(f"127.0.0.1:{port}", config, step_timeout_s=120,
                                    startup_timeout_s=300)
                results += run_mode("grpc", [client], args)
                client.close()
            except Exception:
                worker_log.seek(0)
                log.error("worker log:\n%s", worker_log.read()[-4000:])
                raise
            finally:
                worker.terminate()
                worker.wait(60)

    def describe(r: dict) -> str:
        m = r["median_ms"]
        return (f"{r['mode']} B={r['batch_size']} {m['total']:.1f} ms (forward {m['forward']:.1f}"
                f", prepare {m['prepare']:.2f}, sample {m['sample']:.2f}, schedule "
                f"{m['schedule']:.2f}, rpc {m['rpc']:.2f}, output {m['output']:.2f})")
    line = "step anatomy: " + "; ".join(map(describe, results))
    grpc_big = [r for r in results if r["mode"] == "grpc" and r["batch_size"] >= 32]
    for r in grpc_big:
        met = r["scheduler_plus_rpc_ms"] <= TARGET_OVERHEAD_MS
        r["target"] = {"scheduler_plus_rpc_ms_max": TARGET_OVERHEAD_MS, "met": met}
        line += (f"; scheduler+RPC at B={r['batch_size']}: {r['scheduler_plus_rpc_ms']:.2f} ms "
                 f"(target <= {TARGET_OVERHEAD_MS} ms{'' if met else ' MISSED'})")
    return finish("step_anatomy", args, line, results, model=args.model, dtype="float32")


if __name__ == "__main__":
    main()
