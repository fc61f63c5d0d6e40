"""CUDA graphs for mixed prefill + decode steps, as the calibrated simulator models them: a
model, not a GPU measurement.

The in-process engine serves a closed-loop workload on the simulated worker (device sim,
Llama-3-8B shapes on an H100 SXM by default, step model `kernels`, sim_time_scale 0): N
requests stay in flight, each finished one replaced by the next, ShareGPT-like lengths
(bench/control_plane.py's: prompts median 180 tokens, outputs median 150), so while requests
keep arriving most steps carry a prefill chunk beside the decodes. The same seeded workload
runs once per graph setting:
  eager         enable_cuda_graph off
  decode        decode-only steps replay graphs (max_cuda_graph_tokens 0: the code before)
  mixed         mixed steps too, in token buckets up to --max-cuda-graph-tokens
Each step's modelled cost comes from the step model the worker used (so the graph choice is
the runner's rule, worker_svc/graph_buckets.py). Reported per N and setting: steps, the share
that are mixed and the share replayed as graphs, the modelled GPU time of all steps (each
step's device time: its kernels and, in eager steps, the host's launch stream), output tokens
per modelled second, and that rate over the decode-only setting's, measured in the same run;
beside them the host's modelled launch time (the model thread is held that long, so it is time
the in-process engine's host work cannot overlap).

    python -m bench.step_graphs                        # N = 32, 256
    python -m bench.step_graphs --concurrency 8 --requests-per-client 1 --tag smoke
"""

from __future__ import annotations

import argparse
import logging
from collections import deque

from pagedserve.services.common.sampling_params import SamplingParams

from bench.common import DEFAULT_MODEL, finish
from bench.control_plane import sharegpt_like
from pagedserve.llm_engine import LLMEngine, engine_config_from_kwargs

SETTINGS = {"eager": dict(enable_cuda_graph=False),
            "decode": dict(enable_cuda_graph=True, max_cuda_graph_tokens=0),
            "mixed": dict(enable_cuda_graph=True)}


def serve(args: argparse.Namespace, concurrency: int, setting: str) -> dict:
    engine = LLMEngine(engine_config_from_kwargs(
        model=args.model, device="sim", sim_gpu=args.gpu, sim_model=args.sim_model,
        sim_time_scale=0.0, max_num_seqs=concurrency, seed=args.seed, swap_space_gib=16.0,
        **{"max_cuda_graph_tokens": args.max_cuda_graph_tokens, **SETTINGS[setting]}))
    step_model = engine.core.workers[0].step_model
    price = step_model.step
    steps = []

    def recorded(query_lens: list[int], context_lens: list[int], num_logits_rows: int):
        cost = price(query_lens, context_lens, num_logits_rows)
        steps.append((any(q > 1 for q in query_lens), cost))
        return cost

    step_model.step = recorded
    wl = sharegpt_like(max(args.min_requests, concurrency * args.requests_per_client),
                       engine.core.vocab_size, args.seed, args.max_prompt_len,
                       args.max_output_len)
    queue = deque(range(len(wl.prompts)))

    def submit() -> None:
        i = queue.popleft()
        engine.add_request(f"r{i}", wl.prompts[i], SamplingParams(
            temperature=0.0, max_tokens=wl.output_lens[i], ignore_eos=True))

    for _ in range(min(concurrency, len(queue))):
        submit()
    while engine.has_unfinished_requests():
        for report in engine.step():
            if report.finished and queue:
                submit()
    engine.close()
    gpu_s = sum(cost.device_s for _, cost in steps)
    mixed = [cost for is_mixed, cost in steps if is_mixed]
    return {
        "concurrency": concurrency, "setting": setting, "num_steps": len(steps),
        "mixed_step_share": len(mixed) / len(steps),
        "graph_step_share": sum(cost.is_graph for _, cost in steps) / len(steps),
        "mixed_graph_share": sum(cost.is_graph for cost in mixed) / max(len(mixed), 1),
        "modelled_gpu_s": gpu_s,
        "mean_mixed_step_ms": 1e3 * sum(c.device_s for c in mixed) / max(len(mixed), 1),
        "mean_mixed_step_host_ms": 1e3 * sum(c.host_s for c in mixed) / max(len(mixed), 1),
        "modelled_host_launch_s": sum(cost.host_s for _, cost in steps),
        "output_tok_per_modelled_s": sum(wl.output_lens) / gpu_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="served folder: vocabulary and tokenizer")
    parser.add_argument("--sim-model", default="Llama-3-8B")
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--min-requests", type=int, default=64)
    parser.add_argument("--max-prompt-len", type=int, default=2048)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-cuda-graph-tokens", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="sim")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results, parts = [], []
    for concurrency in args.concurrency:
        by_setting = {setting: serve(args, concurrency, setting) for setting in SETTINGS}
        baseline = by_setting["decode"]["output_tok_per_modelled_s"]
        for result in by_setting.values():
            result["vs_decode_graphs"] = result["output_tok_per_modelled_s"] / baseline
            results.append(result)
        mixed = by_setting["mixed"]
        parts.append(f"N={concurrency}: {mixed['vs_decode_graphs']:.2f}x decode-only graphs "
                     f"({by_setting['eager']['vs_decode_graphs']:.2f}x eager), "
                     f"{mixed['graph_step_share']:.0%} of steps in graphs "
                     f"(was {by_setting['decode']['graph_step_share']:.0%})")
    line = (f"step_graphs (modelled: {args.sim_model} on {args.gpu}, kernels step model): "
            + "; ".join(parts))
    return finish("step_graphs", args, line, results, sim_model=args.sim_model, gpu=args.gpu,
                  is_model=True)


if __name__ == "__main__":
    main()
