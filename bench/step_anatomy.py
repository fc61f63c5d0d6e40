"""Step anatomy: where one engine step's time goes, at decode batch 1 and 32, with the worker
in process and behind gRPC (a `pagedserve.cli worker` process on loopback), each with async
scheduling (the default) and without it, same run.

Per decode-only step with exactly B sequences, medians in ms of:
  period       the engine step as the caller sees it: one step() call, back to back
  cache_ops    swap/copy blocks on the worker
  prepare      mirror deltas + the flattened batch (input ids, positions, slot mapping, ...)
  forward      the model, logits at the sampled rows
  sample       the sampler
  schedule     Scheduler.schedule() (the plan, block tables, deltas)
  output       OutputProcessor.process (append tokens, stop checks, free blocks, reports)
  schedule_cpu, output_cpu   the same two as CPU time of the thread that runs them: in process
               their wall times also hold the waits for the GIL while the model thread has it
  cpu          CPU time of the benchmark's process during the step, all threads: in process it
               includes the model's, so it stays readable when neighbours stretch wall times;
               through gRPC it is the scheduler side's alone
  overhead     period - (cache_ops + prepare + forward + sample): the time per step the worker
               is not working on the model -- the scheduler + RPC overhead the workers see.
               One step at a time it is schedule + RPC (protobuf both ways, loopback, the
               servicer) + output processing; with async scheduling those run while the worker
               computes the next step, and what is left is the hand-off between steps.
               With --device sim, forward is the modelled GPU time (the simulator's: the kernels
               the model code launches, calibrated to an H100 run; the record adds its kernel
               time and the roofline's floor for each batch size), and the worker's host work
               (prepare, sample) runs beside it (it launches a step before finishing the one
               before): overhead is period - forward, the time the GPU would sit idle.
Mode in_process_metrics is in_process with the scheduler's stat loggers attached (its
Prometheus metrics and the stats line), so the cost of recording is the difference between the two.
Target (issue #17): overhead <= 0.3 ms at B = 32 through gRPC. Each mode and batch size is measured --repeats
times and the repeat with the lowest median period is kept (a shared 2-core host has noisy
neighbours; the other benchmarks keep each system's fastest run the same way).
The record goes to bench/results/step_anatomy-<tag>.json.

    python -m bench.step_anatomy
    python -m bench.step_anatomy --batch-sizes 1 4 --output-len 8 --modes grpc --tag smoke
"""

from __future__ import annotations

import argparse
import copy
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

import torch
from pagedserve.scheduler_svc.engine_core import EngineCore, StepFuture, WorkerHandle
from pagedserve.scheduler_svc.metrics import SchedulerMetrics
from pagedserve.scheduler_svc.stats import LoggingStatLogger
from pagedserve.scheduler_svc.worker_client import WorkerClient
from pagedserve.services.common.step_plan import StepOutput, StepPlan, StepTimings
from pagedserve.services.rpc.convert_worker import step_plan_to_proto
from pagedserve.worker_svc.cuda_graphs import MAX_CAPTURE_SEQ_LEN
from pagedserve.worker_svc.graph_buckets import capture_buckets
from pagedserve.worker_svc.sim.roofline import Roofline, resolve_gpu, resolve_model_shape
from pagedserve.worker_svc.sim.step_model import StepModel, traced_ops
from pagedserve.worker_svc.sim.trace import sim_hf_config
from pagedserve.worker_svc.worker import create_worker
from prometheus_client import CollectorRegistry

from bench.common import DEFAULT_MODEL, finish, make_workload, quiet_logging
from pagedserve.llm_engine import engine_config_from_kwargs
from pagedserve.supervisor import free_port

log = logging.getLogger("bench.step_anatomy")

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("period", "cache_ops", "prepare", "forward", "sample", "schedule", "output",
          "overhead", "cpu", "schedule_cpu", "output_cpu")
MODES = {"in_process": False, "in_process_metrics": False, "in_process_sync": False,
         "grpc": True, "grpc_sync": True}
TARGET_OVERHEAD_MS = 0.3


class _TimedStep:
    """A submitted step's future that files the worker's timings under its step id."""

    def __init__(self, future: StepFuture, step_id: int, timings: dict[int, StepTimings]) -> None:
        self._future = future
        self._step_id = step_id
        self._timings = timings

    def result(self, timeout: float | None = None) -> StepOutput:
        output = self._future.result(timeout)
        self._timings[self._step_id] = output.timings
        return output


class StepRecorder:
    """Wraps the engine's scheduler, output processor and rank 0's submit_step on the instance,
    so each step() call is timed without touching the engine's code. A record describes the
    step whose outputs that call processed (`plan`, the worker's `timings`, the engine's
    `outputs`)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.current: dict[str, Any] = {}
        self._timings: dict[int, StepTimings] = {}
        core.scheduler.schedule = self._timed(core.scheduler.schedule, "schedule_ns")
        processor = core.output_processor
        processor.apply = self._timed(processor.apply, "output_ns")
        processor.report = self._timed(processor.report, "output_ns")
        worker = core.workers[0]
        submit_step = worker.submit_step

        def timed_submit(plan: StepPlan) -> StepFuture:
            return _TimedStep(submit_step(plan), plan.step_id, self._timings)

        worker.submit_step = timed_submit

    def _timed(self, fn: Callable, key: str) -> Callable:
        def timed(*args: Any) -> Any:
            cpu_start, start = time.thread_time_ns(), time.perf_counter_ns()
            result = fn(*args)
            self.current[key] = self.current.get(key, 0) + time.perf_counter_ns() - start
            cpu_key = key.replace("_ns", "_cpu_ns")
            self.current[cpu_key] = (self.current.get(cpu_key, 0) + time.thread_time_ns()
                                     - cpu_start)
            return result
        return timed

    def step(self) -> dict[str, Any]:
        self.current = {}
        cpu_start, start = time.process_time_ns(), time.perf_counter_ns()
        outputs = self.core.step()
        self.current["step_ns"] = time.perf_counter_ns() - start
        self.current["step_cpu_ns"] = time.process_time_ns() - cpu_start
        scheduled = self.core.last_scheduled
        if scheduled is not None and scheduled.plan is not None:
            timings = self._timings.pop(scheduled.plan.step_id, None)
            if timings is not None:
                self.current.update(plan=scheduled.plan, timings=timings)
        self.current["outputs"] = outputs
        return self.current


def phases_ms(record: dict[str, Any], is_sim: bool) -> dict[str, float]:
    t = record["timings"]
    worker_ns = t.forward_ns if is_sim else (
        t.cache_ops_ns + t.prepare_ns + t.forward_ns + t.sample_ns)
    ns = {"period": record["step_ns"], "cache_ops": t.cache_ops_ns, "prepare": t.prepare_ns,
          "forward": t.forward_ns, "sample": t.sample_ns,
          "schedule": record.get("schedule_ns", 0), "output": record.get("output_ns", 0),
          "overhead": record["step_ns"] - worker_ns, "cpu": record["step_cpu_ns"],
          "schedule_cpu": record.get("schedule_cpu_ns", 0),
          "output_cpu": record.get("output_cpu_ns", 0)}
    return {name: value / 1e6 for name, value in ns.items()}


def decode_step_seq_ids(plan: StepPlan) -> list[int]:
    """A decode-only step's sequences, each computing one token; [] for any other step."""
    if plan.new_seqs or any(s.num_scheduled_tokens != 1 for s in plan.running_seqs):
        return []
    return [s.seq_id for s in plan.running_seqs] + plan.decode_seq_ids


def measure(recorder: StepRecorder, batch_size: int, repeat: int,
            args: argparse.Namespace) -> dict:
    core = recorder.core
    wl = make_workload(f"b{batch_size}", batch_size, (args.prompt_len,) * 2,
                       (args.output_len,) * 2, core.vocab_size, seed=args.seed + repeat)
    for i, (prompt, sampling) in enumerate(zip(wl.prompts, wl.sampling_params(), strict=True)):
        core.add_request(f"b{batch_size}-r{repeat}-{i}", prompt, sampling)
    samples, request_bytes = [], []
    while core.has_unfinished_requests():
        record = recorder.step()
        if "plan" in record and len(decode_step_seq_ids(record["plan"])) == batch_size:
            samples.append(phases_ms(record, args.device == "sim"))
            request_bytes.append(step_plan_to_proto(record["plan"]).ByteSize())
    samples = samples[args.skip_steps:]
    if not samples:
        raise RuntimeError(f"no decode step ran at batch {batch_size}")
    return {"batch_size": batch_size, "num_steps": len(samples),
            "median_ms": {name: statistics.median(s[name] for s in samples) for name in PHASES},
            "p90_ms": {name: sorted(s[name] for s in samples)[int(0.9 * (len(samples) - 1))]
                       for name in PHASES},
            "step_request_bytes": statistics.median(request_bytes)}


def start_worker(args: argparse.Namespace, port: int, log_file) -> subprocess.Popen:
    argv = [sys.executable, "-m", "pagedserve.cli", "worker", *engine_argv(args),
            "--port", str(port), "--log-level", "WARNING"]
    return subprocess.Popen(argv, cwd=ROOT, stdout=log_file, stderr=log_file,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})


def engine_argv(args: argparse.Namespace) -> list[str]:
    argv = ["--model", args.model, "--device", args.device, "--dtype", _dtype(args),
            "--max-num-seqs", str(max(args.batch_sizes)), "--kv-cache-memory-gib", "0.5",
            "--swap-space-gib", "0.1"]
    if args.device == "sim":
        argv += ["--sim-model", args.sim_model, "--sim-gpu", args.sim_gpu]
    return argv


def engine_kwargs(args: argparse.Namespace, mode: str) -> dict:
    kwargs = {"model": args.model, "device": args.device, "dtype": _dtype(args),
              "max_num_seqs": max(args.batch_sizes), "kv_cache_memory_gib": 0.5,
              "swap_space_gib": 0.1, "async_scheduling": not mode.endswith("_sync")}
    if args.device == "sim":
        kwargs.update(sim_model=args.sim_model, sim_gpu=args.sim_gpu)
    return kwargs


def _dtype(args: argparse.Namespace) -> str:
    return "bfloat16" if args.device == "sim" else "float32"


def run_mode(mode: str, workers: list[WorkerHandle], args: argparse.Namespace) -> list[dict]:
    config = engine_config_from_kwargs(**engine_kwargs(args, mode))
    core = EngineCore(config, workers)
    if mode.endswith("_metrics"):
        core.stat_loggers += [SchedulerMetrics(CollectorRegistry(), "bench", core.get_load),
                              LoggingStatLogger()]
    warm = make_workload("warmup", 2, (16, 16), (4, 4), core.vocab_size, seed=args.seed + 1)
    for i, (prompt, sampling) in enumerate(zip(warm.prompts, warm.sampling_params(),
                                               strict=True)):
        core.add_request(f"warmup-{i}", prompt, sampling)
    while core.has_unfinished_requests():
        core.step()
    recorder = StepRecorder(core)
    results = []
    for batch_size in args.batch_sizes:
        runs = [measure(recorder, batch_size, r, args) for r in range(args.repeats)]
        fastest = min(runs, key=lambda r: r["median_ms"]["period"])
        result = {"mode": mode, **fastest,
                  "period_ms_per_repeat": [r["median_ms"]["period"] for r in runs]}
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
    parser.add_argument("--repeats", type=int, default=2,
                        help="measurements per mode and batch size; the fastest is kept")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES),
                        help="in process or behind gRPC; _sync: without async scheduling")
    parser.add_argument("--device", choices=("cpu", "sim"), default="cpu",
                        help="sim: the forward takes the simulated time of --sim-model on "
                             "--sim-gpu, so the overhead is the one a GPU would see")
    parser.add_argument("--sim-model", default="Llama-3-8B")
    parser.add_argument("--sim-gpu", default="H100-SXM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    results = []
    local_modes = [m for m in args.modes if not MODES[m]]
    if local_modes:
        worker = create_worker(engine_config_from_kwargs(**engine_kwargs(args, local_modes[0])))
        for mode in local_modes:
            results += run_mode(mode, [worker], args)
    remote_modes = [m for m in args.modes if MODES[m]]
    if remote_modes:
        port = free_port()
        with tempfile.TemporaryFile("w+") as worker_log:
            worker = start_worker(args, port, worker_log)
            try:
                for mode in remote_modes:
                    config = engine_config_from_kwargs(**engine_kwargs(args, mode))
                    client = WorkerClient(f"127.0.0.1:{port}", config, step_timeout_s=120,
                                        startup_timeout_s=300)
                    results += run_mode(mode, [client], args)
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
        return (f"{r['mode']} B={r['batch_size']} {m['period']:.1f} ms (forward "
                f"{m['forward']:.1f}, cpu {m['cpu']:.1f}, sample {m['sample']:.2f}, "
                f"prepare {m['prepare']:.2f}, "
                f"schedule {m['schedule']:.2f}, output {m['output']:.2f}, overhead "
                f"{m['overhead']:.2f})")
    line = "step anatomy: " + "; ".join(map(describe, results))
    simulated = {}
    if args.device == "sim":
        simulated = {b: simulated_step(args, b) for b in args.batch_sizes}
        line = (f"step anatomy (forward modelled: {args.sim_model} on {args.sim_gpu}, not a "
                "measurement): " + "; ".join(map(describe, results)) + "; simulated decode step "
                + ", ".join(f"B={b} {s['step_ms']:.2f} ms ({s['kernel_ms']:.2f} ms of kernels, "
                            f"{s['kernels_per_layer']} a layer, "
                            f"{'graph' if s['is_graph'] else 'eager'}; roofline floor "
                            f"{s['roofline_floor_ms']:.2f} ms; with the layers' torch code "
                            f"{s['torch_layers']['step_ms']:.2f} ms, "
                            f"{s['torch_layers']['kernels_per_layer']} kernels a layer)"
                            for b, s in simulated.items()))
    for r in results:
        if r["mode"] == "grpc" and r["batch_size"] >= 32:
            overhead = r["median_ms"]["overhead"]
            met = overhead <= TARGET_OVERHEAD_MS
            r["target"] = {"overhead_ms_max": TARGET_OVERHEAD_MS, "met": met}
            line += (f"; scheduler+RPC overhead through gRPC at B={r['batch_size']}: "
                     f"{overhead:.2f} ms (target <= {TARGET_OVERHEAD_MS} ms"
                     f"{'' if met else ' MISSED'})")
    return finish("step_anatomy", args, line, results, model=args.model, dtype=_dtype(args),
                  simulated_decode_step=simulated)


def simulated_step(args: argparse.Namespace, batch_size: int) -> dict:
    """The simulator's decode step at the run's mean context: the time the worker's forward
    waits, its kernels' share, the roofline's lower bound and the kernels one decoder layer
    adds; beside it, the same step with the layers' torch code (enable_fused_kernels off: a GPU
    step before the fused kernels). Both modelled."""
    return {**_simulated_step(args, batch_size, True),
            "torch_layers": _simulated_step(args, batch_size, False)}


def _simulated_step(args: argparse.Namespace, batch_size: int,
                    enable_fused_kernels: bool) -> dict:
    hf_config = sim_hf_config(args.sim_model)
    one_layer_fewer = copy.copy(hf_config)
    one_layer_fewer.num_hidden_layers -= 1
    floor = Roofline(resolve_model_shape(args.sim_model), resolve_gpu(args.sim_gpu))
    context = args.prompt_len + args.output_len // 2
    buckets = capture_buckets(max(args.batch_sizes), 0, 0, MAX_CAPTURE_SEQ_LEN)
    costs = [StepModel(traced_ops(config, torch.bfloat16, enable_fused_kernels), floor,
                       graph_buckets=buckets
                       ).step([1] * batch_size, [context] * batch_size, batch_size)
             for config in (hf_config, one_layer_fewer)]
    cost = costs[0]
    return {"step_ms": cost.device_s * 1e3, "kernel_ms": cost.kernel_s * 1e3,
            "roofline_floor_ms": cost.roofline_floor_s * 1e3, "is_graph": cost.is_graph,
            "num_kernels": cost.num_kernels,
            "kernels_per_layer": costs[0].num_kernels - costs[1].num_kernels}


if __name__ == "__main__":
    main()
