"""Worker decode: the worker thread's CPU per plain decode step at a small batch, where the
forward is negligible (a one-layer random-weight Llama
with a 512-token vocabulary on CPU, fp32), so what is left is the host work
a step costs on any device: the mirror's deltas, the inputs, the sampler's launch and its result.

`--batch-size` greedy sequences of `--prompt-len` tokens are prefilled in one step, then every
step is a decode of all of them (each sequence holds its blocks from the start, so each decode
goes packed, as the scheduler sends a plain decode), driven through `Worker.execute_step` as the
in-process engine does, plus the plan's and the output's conversions to and from the wire as the
servicer does (`--no-convert` leaves them out). The forward's own CPU time is taken out: the figure is the rest of the step.
Compare two code versions alternated (A B B A).

    python -m bench.worker_decode --tag after
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from pagedserve.services.common.cdiv import cdiv
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import NewSequence, StepPlan
from pagedserve.services.rpc.convert_worker import (
    step_output_to_proto,
    step_plan_from_proto,
    step_plan_to_proto,
)
from pagedserve.services.rpc.internal.v1 import worker_pb2
from pagedserve.worker_svc.worker import create_worker

from bench.common import finish, quiet_logging
from bench.offline_gpu import MODEL_CONFIGS
from pagedserve.llm_engine import engine_config_from_kwargs

# tiny-llama made tinier still: one layer and a small vocabulary keep the forward and the
# sampler's math to a few microseconds of work in each op
_CONFIG = {**MODEL_CONFIGS["tiny-llama"], "num_hidden_layers": 1, "vocab_size": 512,
           "torch_dtype": "float32"}


def write_model_dir(root: Path) -> Path:
    (root / "config.json").write_text(json.dumps(_CONFIG))
    return root


def run_once(args: argparse.Namespace, model_dir: Path) -> tuple[float, float]:
    """Thread CPU seconds of --steps decode steps on a fresh worker, and of its forwards."""
    worker = create_worker(engine_config_from_kwargs(
        model=str(model_dir), load_format="dummy", dtype="float32", device="cpu",
        max_num_seqs=args.batch_size, seed=args.seed, kv_cache_memory_gib=0.25))
    worker.load_model()
    worker.profile_memory()
    num_blocks = cdiv(args.prompt_len + args.steps + 1, worker.kv_spec.block_size)
    epoch = time.time_ns() // 1000
    worker.init_cache(args.batch_size * num_blocks, 0, epoch)
    greedy = SamplingParams(temperature=0.0, max_tokens=args.steps + 1, ignore_eos=True)
    new_seqs = [NewSequence(seq_id=i, request_id=str(i), token_ids=[3 + i] * args.prompt_len,
                            prompt_len=args.prompt_len,
                            block_ids=list(range(i * num_blocks, (i + 1) * num_blocks)),
                            num_computed_tokens=0, num_scheduled_tokens=args.prompt_len,
                            sampling=greedy) for i in range(args.batch_size)]
    worker.execute_step(StepPlan(epoch, 1, new_seqs=new_seqs))
    seq_ids = list(range(args.batch_size))
    plans = [StepPlan(epoch, step_id, previous_step_id=step_id - 1, decode_seq_ids=seq_ids,
                      decode_block_ids_start=[num_blocks] * args.batch_size)
             for step_id in range(2, args.steps + 2)]
    raw = [step_plan_to_proto(plan).SerializeToString() for plan in plans]
    forward_s = [0.0]
    forward = worker.runner._forward

    def timed_forward(*forward_args):
        start = time.thread_time()
        out = forward(*forward_args)
        forward_s[0] += time.thread_time() - start
        return out

    worker.runner._forward = timed_forward

    start = time.thread_time()
    if args.convert:
        for data in raw:
            plan = step_plan_from_proto(worker_pb2.ExecuteStepRequest.FromString(data))
            step_output_to_proto(worker.execute_step(plan)).SerializeToString()
    else:
        for plan in plans:
            worker.execute_step(plan)
    cpu_s = time.thread_time() - start
    worker.close()
    return cpu_s, forward_s[0]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-size", type=int, default=26)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200, help="decode steps a run")
    parser.add_argument("--repeats", type=int, default=5, help="runs; the median is kept")
    parser.add_argument("--no-convert", dest="convert", action="store_false",
                        help="leave out the conversions to and from the wire")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--note", default="")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args(argv)
    quiet_logging()
    with tempfile.TemporaryDirectory(prefix="pagedserve-worker-decode-") as tmp:
        model_dir = write_model_dir(Path(tmp))
        run_once(args, model_dir)  # warm-up
        runs = [run_once(args, model_dir) for _ in range(args.repeats)]
    cpu_us = [1e6 * cpu_s / args.steps for cpu_s, _ in runs]
    forward_us = [1e6 * fwd_s / args.steps for _, fwd_s in runs]
    host_us = [c - f for c, f in zip(cpu_us, forward_us, strict=True)]
    median_us = statistics.median(host_us)
    line = (f"worker_decode: batch {args.batch_size}, {args.steps} decode steps, worker thread "
            f"CPU outside the forward {median_us:.0f} µs a step (median of {args.repeats}; min "
            f"{min(host_us):.0f}; the forward {statistics.median(forward_us):.0f} µs more)")
    return finish("worker_decode", args, line, [{
        "host_us_per_step": host_us, "forward_us_per_step": forward_us,
        "cpu_us_per_step": cpu_us, "median_us": median_us}], note=args.note)


if __name__ == "__main__":
    main()
