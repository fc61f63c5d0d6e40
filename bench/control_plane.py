"""Control plane at GPU speed: the real stack (gateway and scheduler processes, gRPC, the worker
core) in front of a simulated worker (device "sim": Llama-3-8B on an H100 SXM by default), so
that the GPU's step time is the simulator's (the kernels the model code launches, calibrated to
an H100 run) and everything else is measured.

Workload (seeded): ShareGPT-like lengths drawn log-normally -- prompts median 180 tokens
(sigma 1.0, clipped to 4..2048, mean ~300), outputs median 150 (sigma 0.9, clipped to 4..1024,
mean ~225) -- as random token-id prompts; greedy with ignore_eos and max_tokens = the drawn
output length, detokenized, with stop strings on (the gateway checks them every delta).
N streaming clients, closed loop (each sends its next request when one ends).

  busy        per N: simulated kernel time / wall time (target >= 0.95 at N=256): the share of
              time the modelled GPU would be computing; the rest it waits for the control plane
              or, in eager steps, for the host's kernel launches
  capacity    one gateway's delivered output tokens/s with the GPU's time set to zero
              (sim_time_scale 0), and tokens per CPU-second of the gateway process -- what one
              gateway core sustains (target >= 17k/s: an H100 replica at batch 256); compared
              with the roofline's token rate at batch 256 (and the simulator's, recorded beside)
  scheduler   Scheduler.schedule + OutputProcessor.process + the scheduler's side of the
              ExecuteStep conversions (plan to protobuf, response from protobuf) per decode step
              with B running sequences (in process, B = 64 .. 1024, CPU time of the thread), and
              the same B with 8x longer contexts: it should grow with B only, not with tokens or
              blocks

--stream-interval sets the gateway's: clients then read a message per that many tokens.

Every figure is a ratio against the simulated GPU measured in the same run; none is a GPU
measurement. CPU seconds of each process are recorded beside, and per output token
(`cpu_us_per_token`): on a shared host the busy fraction and tokens/s move with the neighbours'
load, CPU time per token much less -- compare runs by it.

    python -m bench.control_plane                 # N = 64, 256, 1024
    python -m bench.control_plane --quick         # a smoke size
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import math
import multiprocessing
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import grpc
from pagedserve.services.common.config import DeviceConfig, EngineConfig, WorkerServiceConfig
from pagedserve.services.common.gc_tuning import tune_gc_after_startup
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.convert_worker import (
    step_output_from_proto,
    step_output_to_proto,
    step_plan_to_proto,
)
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from bench.common import DEFAULT_MODEL, finish, percentiles, quiet_logging
from bench.serving import wait_serving
from pagedserve.llm_engine import LLMEngine, engine_config_from_kwargs
from pagedserve.supervisor import config_to_argv, free_port

log = logging.getLogger("bench.control_plane")

ROOT = Path(__file__).resolve().parents[1]
TARGET_BUSY = 0.95
TARGET_GATEWAY_TOK_S = 17_000
STOP_STRINGS = ["\nUser:", "<|im_end|>"]
_CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def sharegpt_like(num_requests: int, vocab_size: int, seed: int, max_prompt: int = 2048,
                  max_output: int = 1024) -> Workload:
    rng = random.Random(seed)
    low, high = min(1000, vocab_size // 4), vocab_size - min(1000, vocab_size // 4)

    def draw(median: float, sigma: float, cap: int) -> int:
        return max(4, min(cap, round(rng.lognormvariate(math.log(median), sigma))))

    prompts, outs = [], []
    for _ in range(num_requests):
        prompts.append([rng.randrange(low, high) for _ in range(draw(180, 1.0, max_prompt))])
        outs.append(draw(150, 0.9, max_output))
    return Workload(prompts, outs)


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


# --- the stack: worker (a child that reports its simulated GPU time), scheduler, gateway -------


def _worker_main(config: EngineConfig, port: int, conn) -> None:
    from pagedserve.worker_svc.servicer import start_worker

    logging.basicConfig(level=logging.WARNING)

    async def run() -> None:
        server, servicer = await start_worker(config, WorkerServiceConfig(port=port))
        loop = asyncio.get_running_loop()
        while await loop.run_in_executor(None, conn.recv) == "stats":
            worker = servicer.worker
            conn.send(worker.timeline.stats().busy_s if worker is not None else 0.0)
        await server.shutdown(0)
        servicer.close()

    asyncio.run(run())


@dataclass(slots=True)
class Stack:
    worker: multiprocessing.Process
    conn: object
    scheduler: subprocess.Popen
    gateway: subprocess.Popen
    address: str

    def busy_s(self) -> float:
        self.conn.send("stats")
        return self.conn.recv()

    def cpu(self) -> dict[str, float]:
        return {"worker": cpu_seconds(self.worker.pid),
                "scheduler": cpu_seconds(self.scheduler.pid),
                "gateway": cpu_seconds(self.gateway.pid), "clients": cpu_seconds(os.getpid())}

    def stop(self) -> None:
        for process in (self.gateway, self.scheduler):
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
        self.conn.send("stop")
        self.worker.join(30)


def start_stack(config: EngineConfig, log_file, startup_timeout_s: float,
                stream_interval: int = 1) -> Stack:
    worker_port, scheduler_port, gateway_port = free_port(), free_port(), free_port()
    parent, child = multiprocessing.get_context("spawn").Pipe()
    worker = multiprocessing.get_context("spawn").Process(
        target=_worker_main, args=(config, worker_port, child), daemon=True)
    worker.start()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    cli = [sys.executable, "-m", "pagedserve.cli"]
    scheduler = subprocess.Popen(
        [*cli, "scheduler", *config_to_argv(config), "--port", str(scheduler_port),
         "--worker-addresses", f"127.0.0.1:{worker_port}", "--log-level", "WARNING"],
        cwd=ROOT, stdout=log_file, stderr=log_file, env=env)
    gateway = subprocess.Popen(
        [*cli, "gateway", "--port", str(gateway_port), "--scheduler-address",
         f"127.0.0.1:{scheduler_port}", "--max-concurrent-requests", "4096", "--http-port", "0",
         "--stream-interval", str(stream_interval),
         "--log-level", "WARNING"], cwd=ROOT, stdout=log_file, stderr=log_file, env=env)
    stack = Stack(worker, parent, scheduler, gateway, f"127.0.0.1:{gateway_port}")
    try:
        wait_serving(stack.address, gateway, startup_timeout_s)
    except BaseException:
        stack.stop()
        raise
    return stack


# --- clients ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Trace:
    submit_s: float
    times_s: list[float] = field(default_factory=list)
    num_tokens: int = 0


async def _client(stub, wl: Workload, queue: deque[int], traces: list[Trace]) -> None:
    while queue:
        i = queue.popleft()
        request = gateway_pb2.GenerateStreamRequest(
            token_ids=common_pb2.TokenIds(token_ids=wl.prompts[i]),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=wl.output_lens[i],
                                               ignore_eos=True, stop=STOP_STRINGS))
        trace = Trace(time.perf_counter())
        async for delta in stub.GenerateStream(request, timeout=1800):
            if delta.token_ids:
                trace.times_s.append(time.perf_counter())
                trace.num_tokens += len(delta.token_ids)
        traces.append(trace)


async def _drive(address: str, wl: Workload, concurrency: int) -> tuple[float, list[Trace]]:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        queue, traces = deque(range(len(wl.prompts))), []
        start = time.perf_counter()
        await asyncio.gather(*(_client(stub, wl, queue, traces) for _ in range(concurrency)))
        return time.perf_counter() - start, traces


def measure(stack: Stack, wl: Workload, concurrency: int) -> dict:
    busy0, cpu0 = stack.busy_s(), stack.cpu()
    wall_s, traces = asyncio.run(_drive(stack.address, wl, concurrency))
    busy_s, cpu1 = stack.busy_s() - busy0, stack.cpu()
    num_tokens = sum(t.num_tokens for t in traces)
    itl_ms = [(b - a) * 1e3 for t in traces for a, b in itertools.pairwise(t.times_s)]
    cpu = {name: cpu1[name] - cpu0[name] for name in cpu0}
    return {"concurrency": concurrency, "num_requests": len(traces), "wall_s": wall_s,
            "num_output_tokens": num_tokens, "output_tok_s": num_tokens / wall_s,
            "simulated_gpu_s": busy_s, "busy_fraction": busy_s / wall_s,
            "roofline_tok_s": num_tokens / busy_s if busy_s else None,
            "ttft_ms": percentiles([(t.times_s[0] - t.submit_s) * 1e3 for t in traces
                                    if t.times_s]),
            "itl_ms": percentiles(itl_ms), "cpu_s": cpu,
            "cpu_us_per_token": {name: 1e6 * s / num_tokens if num_tokens else None
                                 for name, s in cpu.items()},
            "num_client_messages": sum(len(t.times_s) for t in traces),
            "gateway_tok_per_cpu_s": num_tokens / cpu["gateway"] if cpu["gateway"] else None}


# --- scheduler cost per step, in process -------------------------------------------------------


def _is_full_decode(scheduled, batch_size: int) -> bool:
    return len(scheduled.scheduled) == batch_size and all(
        s.num_scheduled_tokens == 1 for s in scheduled.scheduled)


def scheduler_cost(args: argparse.Namespace, batch_size: int, prompt_len: int) -> dict:
    """Median CPU times (of the engine thread) of Scheduler.schedule, OutputProcessor.process and
    the scheduler's ExecuteStep conversions over the decode-only steps that run exactly
    batch_size sequences (in process; the simulated GPU takes no time; the collector tuned as in
    the service)."""
    token_budget = max(8192, prompt_len)
    engine = LLMEngine(engine_config(args, max_num_seqs=batch_size, sim_time_scale=0.0,
                                     max_num_batched_tokens=token_budget))
    tune_gc_after_startup()
    vocab = engine.core.vocab_size
    rng = random.Random(args.seed)
    # the first sequences decode while the last prompts prefill: they must outlast those steps
    num_prefill_steps = -(-batch_size * prompt_len // token_budget)
    params = SamplingParams(temperature=0.0, max_tokens=num_prefill_steps + args.decode_steps + 4,
                            ignore_eos=True)
    for i in range(batch_size):
        engine.add_request(f"s{i}", [rng.randrange(vocab // 4, vocab * 3 // 4)
                                     for _ in range(prompt_len)], params)
    core = engine.core
    schedule_s: list[float] = []
    process_s: list[float] = []
    rpc_s: list[float] = []
    processor = core.output_processor
    schedule, apply, report = core.scheduler.schedule, processor.apply, processor.report

    def timed_schedule():
        start = time.thread_time()
        scheduled = schedule()
        if scheduled.plan is not None:
            step_plan_to_proto(scheduled.plan)
        if _is_full_decode(scheduled, batch_size):
            schedule_s.append(time.thread_time() - start)
        return scheduled

    full_decode: list[bool] = []  # of the step whose report() comes next

    def timed_apply(scheduled, step_output, *rest):
        response = step_output_to_proto(step_output)  # the worker's side: not counted
        start = time.thread_time()
        step_output = step_output_from_proto(response)
        rpc_end = time.thread_time()
        groups = apply(scheduled, step_output, *rest)
        full_decode.append(_is_full_decode(scheduled, batch_size))
        if full_decode[-1]:
            process_s.append(time.thread_time() - rpc_end)
            rpc_s.append(rpc_end - start)
        return groups

    def timed_report(groups):
        start = time.thread_time()
        outputs = report(groups)
        if full_decode.pop():
            process_s[-1] += time.thread_time() - start
        return outputs

    core.scheduler.schedule = timed_schedule
    processor.apply, processor.report = timed_apply, timed_report
    while engine.has_unfinished_requests():
        engine.step()
    engine.close()
    # the first decode steps settle; schedule_ms includes the plan's conversion to protobuf
    schedule_ms = statistics.median(schedule_s[2:]) * 1e3
    process_ms = statistics.median(process_s[2:]) * 1e3
    response_ms = statistics.median(rpc_s[2:]) * 1e3
    per_step_ms = schedule_ms + process_ms + response_ms
    return {"batch_size": batch_size, "prompt_len": prompt_len, "num_steps": len(process_s),
            "schedule_ms": schedule_ms, "process_ms": process_ms,
            "response_from_proto_ms": response_ms, "per_step_ms": per_step_ms,
            "per_seq_us": per_step_ms * 1e3 / batch_size}


# --- main -------------------------------------------------------------------------------------


def engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    options = dict(model=args.model, device="sim", sim_gpu=args.gpu, sim_model=args.sim_model,
                   max_num_seqs=max(args.concurrency), max_num_batched_tokens=8192,
                   seed=args.seed, swap_space_gib=16.0)
    return engine_config_from_kwargs(**{**options, **overrides})


def run_stack(args: argparse.Namespace, config: EngineConfig, levels: list[int],
              stack_log) -> list[dict]:
    stack = start_stack(config, stack_log, args.startup_timeout_s, args.stream_interval)
    try:
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        warm = sharegpt_like(8, vocab, args.seed + 1, args.max_prompt_len, args.max_output_len)
        measure(stack, replace(warm, output_lens=[8] * 8), 8)
        results = []
        for n in levels:
            wl = sharegpt_like(max(n * args.requests_per_client, args.min_requests), vocab,
                               args.seed + n, args.max_prompt_len, args.max_output_len)
            results.append(measure(stack, wl, n))
            log.info("N=%d: %s", n, results[-1])
        return results
    finally:
        stack.stop()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="served folder: tokenizer and vocabulary")
    parser.add_argument("--sim-model", default="Llama-3-8B")
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--capacity-concurrency", type=int, default=256)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--min-requests", type=int, default=8)
    parser.add_argument("--max-prompt-len", type=int, default=2048)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 128, 256, 512, 1024])
    parser.add_argument("--decode-steps", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=128,
                        help="scheduler cost: each sequence's prompt")
    parser.add_argument("--long-prompt-len", type=int, default=1024,
                        help="scheduler cost: the same batch again with prompts this long")
    parser.add_argument("--stream-interval", type=int, default=1,
                        help="the gateway's --stream-interval: output tokens per message")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    parser.add_argument("--quick", action="store_true",
                        help="smoke sizes: N = 4 and 16, short requests, batch 8 and 32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="sim")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.capacity_concurrency = [4, 16], 16
        args.requests_per_client, args.min_requests = 1, 4
        args.max_prompt_len, args.max_output_len = 64, 32
        args.batch_sizes, args.decode_steps = [8, 32], 8
        args.prompt_len, args.long_prompt_len = 16, 128
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryFile("w+") as stack_log:
        try:
            streams = run_stack(args, engine_config(args), args.concurrency, stack_log)
            (capacity,) = run_stack(args, engine_config(args, sim_time_scale=0.0),
                                    [args.capacity_concurrency], stack_log)
        except Exception:
            stack_log.seek(0)
            log.error("stack log:\n%s", stack_log.read()[-4000:])
            raise
    small, large = min(args.batch_sizes), max(args.batch_sizes)
    sched = [scheduler_cost(args, b, args.prompt_len) for b in args.batch_sizes]
    sched.append(scheduler_cost(args, max(b for b in args.batch_sizes if b <= 256),
                                args.long_prompt_len))
    growth = (sched[len(args.batch_sizes) - 1]["per_step_ms"] / sched[0]["per_step_ms"]) / (
        large / small)
    by_n = {r["concurrency"]: r for r in streams}
    busy_target_n = 256 if 256 in by_n else max(by_n)
    busy = by_n[busy_target_n]["busy_fraction"]
    decode_256 = _roofline_decode_tok_s(args)
    gw = capacity["gateway_tok_per_cpu_s"]
    line = ("control plane (sim " + f"{args.sim_model} on {args.gpu}, models not measurements; "
            + f"stream interval {args.stream_interval}): "
            + ", ".join(f"N={r['concurrency']} GPU busy {r['busy_fraction']:.1%} "
                        f"({r['output_tok_s']:.0f} tok/s)" for r in streams)
            + f" (target >= {TARGET_BUSY:.0%} at N={busy_target_n}"
            + f"{'' if busy >= TARGET_BUSY else ' MISSED'}); CPU us per token at "
            + f"N={busy_target_n}: " + ", ".join(
                f"{name} {us:.0f}" for name, us in by_n[busy_target_n]["cpu_us_per_token"].items())
            + "; gateway "
            + f"{capacity['output_tok_s']:.0f} tok/s delivered, {gw:.0f} tok per gateway "
            + f"CPU-s = {gw / decode_256:.2f}x the roofline's batch-256 rate "
            + f"{decode_256:.0f} tok/s (target >= {TARGET_GATEWAY_TOK_S}"
            + f"{'' if gw >= TARGET_GATEWAY_TOK_S else ' MISSED'}); scheduler "
            + ", ".join(f"B={r['batch_size']} x {r['prompt_len']} tokens "
                        f"{r['per_step_ms']:.2f} ms" for r in sched)
            + f" per step ({growth:.2f}x linear from B={small} to {large})")
    return finish("control_plane", args, line,
                  {"streams": streams, "capacity": capacity, "scheduler": sched},
                  targets={"busy_fraction": {"at": busy_target_n, "min": TARGET_BUSY,
                                             "got": busy, "met": busy >= TARGET_BUSY},
                           "gateway_tok_per_cpu_s": {"min": TARGET_GATEWAY_TOK_S, "got": gw,
                                                     "met": gw >= TARGET_GATEWAY_TOK_S}},
                  roofline_decode_tok_s_at_256=decode_256,
                  simulated_decode_tok_s_at_256=_simulated_decode_tok_s(args),
                  scheduler_growth_vs_linear=growth,
                  load_average_before=load_before, stream_interval=args.stream_interval,
                  sim_model=args.sim_model, gpu=args.gpu)


MEAN_CONTEXT = 300 + 225 // 2  # the workload's mean prompt and half its mean output


def _roofline_decode_tok_s(args: argparse.Namespace) -> float:
    """Tokens/s of the modelled GPU decoding 256 sequences at the workload's mean context."""
    from pagedserve.worker_svc.sim.roofline import Roofline, resolve_gpu, resolve_model_shape

    roofline = Roofline(resolve_model_shape(args.sim_model), resolve_gpu(args.gpu),
                        overhead_s=DeviceConfig().sim_launch_overhead_us * 1e-6)
    return 256 / roofline.step([1] * 256, [MEAN_CONTEXT] * 256, 256).time_s


def _simulated_decode_tok_s(args: argparse.Namespace) -> float:
    """The same with the simulator's step time (a CUDA-graph replay at batch 256)."""
    import torch
    from pagedserve.worker_svc.cuda_graphs import MAX_CAPTURE_SEQ_LEN
    from pagedserve.worker_svc.graph_buckets import capture_buckets
    from pagedserve.worker_svc.sim.roofline import Roofline, resolve_gpu, resolve_model_shape
    from pagedserve.worker_svc.sim.step_model import StepModel, traced_ops
    from pagedserve.worker_svc.sim.trace import sim_hf_config

    model = StepModel(traced_ops(sim_hf_config(args.sim_model), torch.bfloat16),
                      Roofline(resolve_model_shape(args.sim_model), resolve_gpu(args.gpu)),
                      graph_buckets=capture_buckets(256, 0, 0, MAX_CAPTURE_SEQ_LEN))
    return 256 / model.step([1] * 256, [MEAN_CONTEXT] * 256, 256).device_s


if __name__ == "__main__":
    main()
