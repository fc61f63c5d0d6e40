"""The scheduler's host work per decode step, with no worker beside it: Scheduler.schedule(), the
output processing (OutputProcessor.apply) and the reports (OutputProcessor.report) over B
single-sequence decodes, each step answered by a scripted sample (one distinct token a sequence,
packed as the worker returns single samples). Times are the CPU time of this thread, so a
neighbour on a shared host stretches them less than wall times; each batch size runs --repeats
times and keeps, per phase, the lowest of the repeats' medians. Compare code versions by
alternating runs (A B B A): no baseline runs in the same process.
The record goes to bench/results/scheduler_host-<tag>.json.

    python -m bench.scheduler_host --batch-sizes 26 256
"""

from __future__ import annotations

import argparse
import gc
import itertools
import statistics
import time

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.output_processor import OutputProcessor
from pagedserve.scheduler_svc.scheduler import Scheduler
from pagedserve.scheduler_svc.sequence import SequenceGroup
from pagedserve.scheduler_svc.step_window import SentStep
from pagedserve.services.common.config import SchedulerConfig
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import StepOutput

from bench.common import finish, quiet_logging

PHASES = ("schedule", "apply", "report")
BLOCK_SIZE = 16


def measure(batch_size: int, args: argparse.Namespace) -> dict[str, float]:
    """Median thread-CPU ms per decode step of each phase, after one prefill step."""
    max_model_len = args.prompt_len + args.num_steps + 2
    blocks_per_seq = -(-max_model_len // BLOCK_SIZE)
    block_manager = BlockManager(BLOCK_SIZE, batch_size * blocks_per_seq, 0, watermark=0.0)
    config = SchedulerConfig(max_num_seqs=batch_size,
                             max_num_batched_tokens=max(2048, batch_size * args.prompt_len))
    scheduler = Scheduler(config, block_manager, max_model_len)
    seq_ids = itertools.count()
    processor = OutputProcessor(scheduler, [0], max_model_len, seq_ids)
    sampling = SamplingParams(max_tokens=args.num_steps + 1, ignore_eos=True)
    for i in range(batch_size):
        prompt = [1 + (i + j) % 1000 for j in range(args.prompt_len)]
        scheduler.add_group(SequenceGroup.from_prompt(f"r{i}", prompt, sampling, next(seq_ids)))
    times: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for step in range(args.num_steps + 1):
        start = time.thread_time_ns()
        scheduled = scheduler.schedule()
        scheduled_ns = time.thread_time_ns()
        # packed, as the worker returns a step where every row drew one token
        sampled_seq_ids = [item.seq.seq_id for item in scheduled.scheduled if item.is_sampling]
        output = StepOutput(scheduled.plan.step_id, sampled_seq_ids=sampled_seq_ids,
                            sampled_token_ids=[2 + step % 1000] * len(sampled_seq_ids),
                            sampled_logprobs=[-0.5] * len(sampled_seq_ids))
        applied_start = time.thread_time_ns()
        sent = SentStep(scheduled, [])
        sent.take_in()
        groups = processor.apply(sent.scheduled, output)
        applied_ns = time.thread_time_ns()
        processor.report(groups)
        reported_ns = time.thread_time_ns()
        if step:  # the first step prefills
            times["schedule"].append((scheduled_ns - start) / 1e6)
            times["apply"].append((applied_ns - applied_start) / 1e6)
            times["report"].append((reported_ns - applied_ns) / 1e6)
    return {phase: statistics.median(values) for phase, values in times.items()}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[26, 256])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--num-steps", type=int, default=64, help="decode steps a repeat")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    gc.collect()
    gc.freeze()  # as the scheduler service does after start-up: no full collection over imports
    results = []
    try:
        for batch_size in args.batch_sizes:
            runs = [measure(batch_size, args) for _ in range(args.repeats)]
            best = {phase: min(run[phase] for run in runs) for phase in PHASES}
            results.append({"batch_size": batch_size,
                            "ms": {**best, "total": sum(best.values())}, "ms_per_repeat": runs})
    finally:
        gc.unfreeze()
    line = "scheduler host CPU per decode step: " + "; ".join(
        f"B={r['batch_size']} " + ", ".join(f"{k} {v:.3f}" for k, v in r["ms"].items())
        for r in results) + " ms"
    return finish("scheduler_host", args, line, results)


if __name__ == "__main__":
    main()
