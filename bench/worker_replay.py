"""Worker replay: the worker's host CPU per engine step on one fixed sequence of steps.

`bench.serving --device sim` measures a worker's CPU per token inside the whole stack, where the
number of steps a run takes (and so the per-step share) moves with how the processes met on the
host. This bench holds the steps fixed: `--capture` runs the closed-loop workload of
`bench.serving` (N streams, greedy, ignore_eos) on the in-process engine with the simulated GPU
and stores every step's ExecuteStepRequest bytes; a replay feeds them, in order, to a fresh
simulated worker the way the servicer does (parse, convert, run, convert the output back,
serialize) and times that thread's CPU. `--launch-ahead` replays through the worker's launch
window with the modelled device time, so steps launch ahead of the one in flight as they do in
the stack (the device's time is slept, not counted). The model math is modelled; the rest is the
worker's real code. Compare two code versions on one capture, alternated (A B B A).

    python -m bench.worker_replay --capture /tmp/steps.bin
    python -m bench.worker_replay --steps /tmp/steps.bin --launch-ahead --tag after
"""

from __future__ import annotations

import argparse
import logging
import pickle
import statistics
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path

from pagedserve.services.common.gc_tuning import tune_gc_after_load
from pagedserve.services.rpc.convert_worker import (
    step_output_to_proto,
    step_plan_from_proto,
    step_plan_to_proto,
)
from pagedserve.services.rpc.internal.v1 import worker_pb2
from pagedserve.worker_svc.worker import Worker, create_worker

from bench.common import DEFAULT_MODEL, finish, make_workload, quiet_logging
from pagedserve.llm_engine import LLMEngine, engine_config_from_kwargs

log = logging.getLogger("bench.worker_replay")


def engine_kwargs(args: argparse.Namespace, time_scale: float) -> dict:
    return dict(model=args.model, device="sim", sim_model=args.sim_model, sim_gpu=args.sim_gpu,
                max_num_seqs=args.concurrency, swap_space_gib=0.25, seed=args.seed,
                sim_time_scale=time_scale)


def capture(args: argparse.Namespace) -> None:
    """The steps of one closed-loop run (no modelled time: the plans do not depend on it)."""
    engine = LLMEngine.from_kwargs(**engine_kwargs(args, 0.0))
    worker = engine._local_workers[0]
    plans: list[bytes] = []
    submit = worker.submit_step

    def recording_submit(plan):
        plans.append(step_plan_to_proto(plan).SerializeToString())
        return submit(plan)

    worker.submit_step = recording_submit
    wl = make_workload("replay", args.concurrency * args.requests_per_client,
                       (args.min_prompt_len, args.max_prompt_len),
                       (args.min_output_len, args.max_output_len), engine.core.vocab_size,
                       args.seed)
    params = wl.sampling_params()
    pending, live = deque(range(len(wl.prompts))), set()
    while pending or live:
        while pending and len(live) < args.concurrency:
            i = pending.popleft()
            engine.add_request(str(i), wl.prompts[i], params[i])
            live.add(str(i))
        live.difference_update(out.request_id for out in engine.step() if out.finished)
    cache = worker.cache_engine
    sizes = (cache.num_gpu_blocks, cache.num_cpu_blocks, worker.scheduler_epoch)
    engine.close()
    Path(args.capture).write_bytes(pickle.dumps((sizes, plans)))
    log.info("captured %d steps into %s", len(plans), args.capture)


def replay_once(args: argparse.Namespace, sizes: tuple[int, int, int],
                plans: list[bytes]) -> tuple[float, int]:
    """(thread CPU seconds, steps launched ahead) of one replay on a fresh worker."""
    worker: Worker = create_worker(engine_config_from_kwargs(
        **engine_kwargs(args, 1.0 if args.launch_ahead else 0.0)))
    worker.load_model()
    worker.profile_memory()
    worker.init_cache(*sizes)
    tune_gc_after_load()  # as the worker service does after its load

    def respond(output) -> bytes:
        return step_output_to_proto(output).SerializeToString()

    start = time.thread_time()
    for raw in plans:
        plan = step_plan_from_proto(worker_pb2.ExecuteStepRequest.FromString(raw))
        if args.launch_ahead:
            worker.check_step(plan)
            worker.steps.launch(worker, plan, Future(), respond)
            worker.steps.submitted_step_id = plan.step_id
        else:
            respond(worker.execute_step(plan))
    worker.steps.finish()
    cpu_s = time.thread_time() - start
    num_ahead = worker.steps.num_launched_ahead
    worker.close()
    return cpu_s, num_ahead


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="vocabulary and EOS")
    parser.add_argument("--sim-model", default="SmolLM2-1.7B")
    parser.add_argument("--sim-gpu", default="H100-SXM")
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--min-output-len", type=int, default=32)
    parser.add_argument("--max-output-len", type=int, default=96)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capture", default="", help="run the workload, store its steps here")
    parser.add_argument("--steps", default="", help="replay the steps stored here")
    parser.add_argument("--launch-ahead", action="store_true",
                        help="through the launch window, with the modelled device time")
    parser.add_argument("--repeats", type=int, default=5, help="replays; the median is kept")
    parser.add_argument("--note", default="")
    parser.add_argument("--tag", default="sim")
    args = parser.parse_args(argv)
    quiet_logging()
    if args.capture:
        capture(args)
        return {}
    sizes, plans = pickle.loads(Path(args.steps).read_bytes())
    replay_once(args, sizes, plans[:8])  # warm-up: imports, first-call paths
    runs = [replay_once(args, sizes, plans) for _ in range(args.repeats)]
    cpu_us = [1e6 * cpu_s / len(plans) for cpu_s, _ in runs]
    median_us = statistics.median(cpu_us)
    mode = (f"launched ahead {runs[0][1]} of them" if args.launch_ahead
            else "one step at a time")
    line = (f"worker_replay: {len(plans)} steps, worker thread CPU {median_us:.0f} µs a step "
            f"(median of {args.repeats}; min {min(cpu_us):.0f}), {mode}")
    results = [{"num_steps": len(plans), "cpu_us_per_step": cpu_us, "median_us": median_us,
                "num_launched_ahead": [ahead for _, ahead in runs]}]
    return finish("worker_replay", args, line, results, note=args.note)


if __name__ == "__main__":
    main()
