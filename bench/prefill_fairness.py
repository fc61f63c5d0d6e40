"""Prefill fairness: a short request's time to first token (TTFT) beside a 7,000-token prefill,
against the same request alone, same run, for each token budget in --budgets.

The engine is the scheduler service's loop (AsyncEngine over EngineCore) in process, with the
CPU worker and the default model; no gateway, no gRPC. Per budget (max_num_batched_tokens):
the short request alone (--repeats times, median), the long prompt alone, then the long prompt
with the short one sent --arrival-s after it, twice: as the service runs it, and the control,
the engine loop as on 9262bf6 (it planned the next step before applying an arrival). Steps come
from the worker's plans: `steps_to_first_token` counts the steps that ended after the one
running at the short request's arrival, up to its first token (target, issue 27: at most 2). The record goes to bench/results/prefill_fairness-<tag>.json.

    python -m bench.prefill_fairness
    python -m bench.prefill_fairness --budgets 512 --long-prompt-len 2000 --tag smoke
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import threading
import time
from dataclasses import dataclass, field

from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.services.common.engine_api import SubmitRequest
from pagedserve.services.common.sampling_params import SamplingParams

from bench.common import DEFAULT_MODEL, finish, quiet_logging
from pagedserve.llm_engine import LLMEngine

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


@dataclass
class StepLog:
    """When each step was sent and ended, its tokens and the requests it started."""

    sent_s: dict[int, float] = field(default_factory=dict)
    ended_s: dict[int, float] = field(default_factory=dict)
    num_tokens: dict[int, int] = field(default_factory=dict)
    started: dict[str, int] = field(default_factory=dict)  # request_id -> its first step
    lock: threading.Lock = field(default_factory=threading.Lock)

    def running_at(self, t: float) -> int | None:
        with self.lock:
            return min((s for s, sent in self.sent_s.items()
                        if sent <= t and self.ended_s.get(s, float("inf")) > t), default=None)

    def num_ended(self, start: float, end: float) -> int:
        with self.lock:
            return sum(start < t <= end for t in self.ended_s.values())


class LoggedWorker:
    def __init__(self, worker, log: StepLog) -> None:
        self.worker = worker
        self.log = log

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def submit_step(self, plan):
        log = self.log
        with log.lock:
            log.sent_s[plan.step_id] = time.perf_counter()
            log.num_tokens[plan.step_id] = plan.num_scheduled_tokens
            for seq in plan.new_seqs:
                log.started.setdefault(seq.request_id, plan.step_id)
        future = self.worker.submit_step(plan)

        def ended(_) -> None:
            with log.lock:
                log.ended_s[plan.step_id] = time.perf_counter()

        future.add_done_callback(ended)
        return future


async def first_token_s(engine_loop: AsyncEngine, request_id: str, prompt: list[int]) -> float:
    start = time.perf_counter()
    sink: asyncio.Queue = asyncio.Queue()
    await engine_loop.submit(SubmitRequest(request_id, prompt, ONE_TOKEN), sink)
    elapsed = None
    while True:
        report = await sink.get()
        if elapsed is None and report.outputs and report.outputs[0].token_ids:
            elapsed = time.perf_counter() - start
        if report.finished:
            break
    if elapsed is None:
        raise RuntimeError(f"{request_id} ended without a token")
    return elapsed


async def beside(engine_loop: AsyncEngine, log: StepLog, tag: str, long_prompt: list[int],
                 short_prompt: list[int], arrival_s: float) -> dict:
    long_task = asyncio.create_task(first_token_s(engine_loop, f"long-{tag}", long_prompt))
    await asyncio.sleep(arrival_s)
    arrival = time.perf_counter()
    running = log.running_at(arrival)
    short_ttft = await first_token_s(engine_loop, f"short-{tag}", short_prompt)
    long_ttft = await long_task
    short_step = log.started[f"short-{tag}"]
    return {"short_ttft_s": short_ttft, "long_ttft_s": long_ttft, "step_running_at_arrival": running,
            "short_first_step": short_step,
            "steps_to_first_token": log.num_ended(log.ended_s.get(running, arrival),
                                                  arrival + short_ttft),
            "step_tokens": [log.num_tokens[s] for s in sorted(log.num_tokens)
                            if running is not None and running <= s <= short_step]}


def hold_nothing(engine_loop: AsyncEngine) -> None:
    """The control: every step is planned ahead, queued arrivals or not (as on 9262bf6)."""
    step = engine_loop.core.step
    engine_loop.core.step = lambda has_queued_operations=None: step()


async def run_budget(args: argparse.Namespace, budget: int) -> dict:
    engine = LLMEngine.from_kwargs(model=args.model, device="cpu", dtype="float32",
                                   max_num_batched_tokens=budget, kv_cache_memory_gib=1.0)
    log = StepLog()
    engine.core.workers = [LoggedWorker(engine.core.workers[0], log)]
    rng = random.Random(args.seed)
    long_prompt = [rng.randrange(3, engine.core.vocab_size) for _ in range(args.long_prompt_len)]
    short_prompt = [rng.randrange(3, engine.core.vocab_size) for _ in range(args.short_prompt_len)]
    engine_loop = await AsyncEngine.start(lambda: engine.core, stop_timeout_s=60.0)
    try:
        await first_token_s(engine_loop, "warm-up", short_prompt)
        alone = [await first_token_s(engine_loop, f"alone-{i}", short_prompt)
                 for i in range(args.repeats)]
        long_alone = await first_token_s(engine_loop, "long-alone", long_prompt)
        held = await beside(engine_loop, log, "held", long_prompt, short_prompt, args.arrival_s)
        hold_nothing(engine_loop)
        control = await beside(engine_loop, log, "control", long_prompt, short_prompt,
                               args.arrival_s)
    finally:
        await engine_loop.stop()
    short_alone = statistics.median(alone)
    return {"max_num_batched_tokens": budget,
            "threshold": engine.core.scheduler.long_prefill_token_threshold,
            "short_alone_ttft_s": short_alone, "short_alone_runs_s": alone,
            "long_alone_ttft_s": long_alone, "beside": held, "beside_control": control,
            "ratio_beside_vs_alone": held["short_ttft_s"] / short_alone,
            "ratio_control_vs_alone": control["short_ttft_s"] / short_alone,
            "long_beside_vs_alone": held["long_ttft_s"] / long_alone}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--budgets", type=int, nargs="+", default=[2048, 512])
    parser.add_argument("--long-prompt-len", type=int, default=7000)
    parser.add_argument("--short-prompt-len", type=int, default=16)
    parser.add_argument("--arrival-s", type=float, default=1.0,
                        help="the short request is sent this long after the long one")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    load_at_start = round(os.getloadavg()[0], 2)  # a shared host: neighbours stretch every step
    results = [asyncio.run(run_budget(args, budget)) for budget in args.budgets]
    line = "prefill_fairness: short TTFT beside a {}-token prefill vs alone: {}".format(
        args.long_prompt_len, "; ".join(
            f"budget {r['max_num_batched_tokens']}: {r['beside']['short_ttft_s']:.2f} s = "
            f"{r['ratio_beside_vs_alone']:.1f}x in {r['beside']['steps_to_first_token']} steps "
            f"(control {r['beside_control']['short_ttft_s']:.2f} s in "
            f"{r['beside_control']['steps_to_first_token']} steps; alone "
            f"{r['short_alone_ttft_s']:.2f} s; long prefill {r['long_beside_vs_alone']:.2f}x "
            "its time alone)" for r in results))
    return finish("prefill_fairness", args, line, results,
                  load_average_1m_at_start=load_at_start)


if __name__ == "__main__":
    main()
