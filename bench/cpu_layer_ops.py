"""Decode steps of a real model in the in-process engine on CPU with one of its C++ kernels and
without, in one process, turned off and on between rounds (A B, then B A), --repeats rounds:
--toggle layer_ops, the layers' C++ ops (`kernels/cpu_layer_ops.py`: RMSNorm and its residual
add, SiLU-and-mul, rotary + K/V cache write, one call each) against their torch code; or
--toggle linears, the skinny linear kernel (`kernels/cpu_linear.py`) against `F.linear` (BLAS;
oneDNN for bf16). Each round serves --batch-size greedy requests of --prompt-len random tokens
until they finish; per way, the worker's forward time of each decode step past the first
--skip-steps (the model alone, sampling and scheduling apart), min and median, and the step's
wall time; and whether the outputs were equal across the ways (fp32: they should be; bf16
rounds differently in each).

    python -m bench.cpu_layer_ops                          # SmolLM2-135M-Instruct, batches 1 8 32
    python -m bench.cpu_layer_ops --batch-sizes 1 --repeats 6
    python -m bench.cpu_layer_ops --toggle linears --dtype bfloat16 --batch-sizes 1 8
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
from pagedserve.kernels import cpu_layer_ops, cpu_linear
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.layers.fused import FusedLayer
from pagedserve.worker_svc.loader import load_hf_config

from bench.common import DEFAULT_MODEL, finish, quiet_logging
from bench.step_anatomy import StepRecorder, decode_step_seq_ids
from pagedserve.llm_engine import LLMEngine

WAYS = ("kernels", "torch")


def set_way(engine: LLMEngine, toggle: str, way: str, max_rows: dict[torch.dtype, int]) -> None:
    """max_rows: what `cpu_linear.max_rows()` held at the start, which the kernels way restores."""
    if toggle == "linears":
        cpu_linear.max_rows().clear()
        if way == "kernels":
            cpu_linear.max_rows().update(max_rows)
        return
    for module in engine.core.workers[0].runner.model.modules():
        if isinstance(module, FusedLayer):
            module.enable_fused_kernels = way == "kernels"


def run_round(engine: LLMEngine, recorder: StepRecorder, prompts: list[list[int]],
              max_tokens: int, skip_steps: int) -> tuple[list[float], list[float], list]:
    """Forward and step ms of each decode step of the whole batch; the outputs' token ids."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    forward_ms, step_ms = [], []
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    num_decodes = 0
    while engine.has_unfinished_requests():
        record = recorder.step()
        for output in record["outputs"]:  # each a delta: the step's new tokens
            outputs[output.request_id] += output.outputs[0].token_ids
        plan = record.get("plan")
        if plan is None or len(decode_step_seq_ids(plan)) != len(prompts):
            continue
        num_decodes += 1
        if num_decodes > skip_steps:
            forward_ms.append(record["timings"].forward_ns / 1e6)
            step_ms.append(record["step_ns"] / 1e6)
    return forward_ms, step_ms, [outputs[str(i)] for i in range(len(prompts))]


def run_batch(engine: LLMEngine, recorder: StepRecorder, batch_size: int, args) -> dict:  # noqa: ANN001
    rng = random.Random(batch_size)
    vocab_size = load_hf_config(args.model).vocab_size
    prompts = [[rng.randrange(vocab_size) for _ in range(args.prompt_len)]
               for _ in range(batch_size)]
    forward: dict[str, list[float]] = {way: [] for way in WAYS}
    step: dict[str, list[float]] = {way: [] for way in WAYS}
    outputs = {}
    max_rows = dict(cpu_linear.max_rows())
    try:
        for r in range(args.repeats + 1):  # round 0 warms both ways up, unrecorded
            for way in (WAYS if r % 2 == 0 else reversed(WAYS)):
                set_way(engine, args.toggle, way, max_rows)
                f, s, outputs[way] = run_round(engine, recorder, prompts, args.max_tokens,
                                               args.skip_steps)
                if r > 0:
                    forward[way] += f
                    step[way] += s
    finally:
        set_way(engine, args.toggle, "kernels", max_rows)
    return {"batch_size": batch_size, "outputs_equal": outputs["kernels"] == outputs["torch"],
            **{f"{way}_forward_ms": {"min": min(forward[way]),
                                     "median": statistics.median(forward[way]),
                                     "num_steps": len(forward[way])} for way in WAYS},
            **{f"{way}_step_ms_median": statistics.median(step[way]) for way in WAYS}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL))
    parser.add_argument("--toggle", choices=["layer_ops", "linears"], default="layer_ops")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--skip-steps", type=int, default=2, help="decode steps not timed a round")
    parser.add_argument("--repeats", type=int, default=4, help="timed rounds per way")
    parser.add_argument("--note", default="")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args(argv)
    quiet_logging()
    kernel = cpu_layer_ops.load() if args.toggle == "layer_ops" else cpu_linear.load()
    if kernel is None:
        raise SystemExit(f"the {args.toggle} kernel is not built on this host")
    engine = LLMEngine.from_kwargs(model=args.model, device="cpu", dtype=args.dtype,
                                   max_num_seqs=max(args.batch_sizes))
    try:
        recorder = StepRecorder(engine.core)
        results = [run_batch(engine, recorder, n, args) for n in args.batch_sizes]
    finally:
        engine.close()
    line = (f"cpu_layer_ops: {args.dtype}, decode forward median with / without the "
            f"{args.toggle} kernel: ") + "; ".join(
        f"batch {r['batch_size']} {r['kernels_forward_ms']['median']:.1f} / "
        f"{r['torch_forward_ms']['median']:.1f} ms" for r in results)
    return finish("cpu_layer_ops", args, line, results, note=args.note,
                  num_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
