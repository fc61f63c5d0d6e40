"""The collector's pauses in `LLM.generate`: the in-process engine on the simulated GPU (the
model math modelled, the host's Python real), N streams of the closed `bench.serving` shape,
with the collector's thresholds as `LLM` raises them while it steps and with CPython's defaults,
alternated (A B B A ...) in one process. Reports output tokens/s and every collection's pause,
by generation (from `gc.callbacks`).

    python -m bench.gc_pauses
    python -m bench.gc_pauses --num-prompts 256 --repeats 1 --tag smoke
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import statistics
import time
from unittest import mock

from pagedserve.services.common.sampling_params import SamplingParams

from bench.common import DEFAULT_MODEL, finish, make_workload, quiet_logging
from pagedserve.llm import LLM

log = logging.getLogger("bench.gc_pauses")

ARMS = ("raised", "defaults")


class Pauses:
    """Each collection's generation and seconds, while attached."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float]] = []
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._start))

    def summary(self) -> dict:
        by_generation = {}
        for generation in (0, 1, 2):
            seconds = [s for g, s in self.pauses if g == generation]
            by_generation[f"gen{generation}"] = {
                "count": len(seconds), "total_ms": 1e3 * sum(seconds),
                "max_ms": 1e3 * max(seconds, default=0.0)}
        return by_generation


def run_arm(llm: LLM, arm: str, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    """One generate of the whole workload; "defaults" steps with CPython's thresholds."""
    pauses = Pauses()
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    keep = mock.patch("pagedserve.llm.raised_thresholds", contextlib.nullcontext)
    gc.callbacks.append(pauses)
    try:
        with keep if arm == "defaults" else contextlib.nullcontext():
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall_s = time.perf_counter() - start
    finally:
        gc.callbacks.remove(pauses)
        gc.set_threshold(*before)
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    collections = pauses.summary()
    return {"arm": arm, "output_tokens": tokens, "wall_s": wall_s,
            "output_tok_s": tokens / wall_s, "collections": collections,
            "collector_ms": sum(g["total_ms"] for g in collections.values())}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    llm = LLM(args.model, device="sim", sim_model=args.sim_model, sim_gpu=args.sim_gpu,
              max_num_seqs=args.concurrency, swap_space_gib=0.25, seed=args.seed)
    wl = make_workload("closed", args.num_prompts, (args.min_prompt_len, args.max_prompt_len),
                       (args.min_output_len, args.max_output_len), llm.engine.core.vocab_size,
                       seed=args.seed)
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0)
              for n in wl.output_lens]
    llm.generate(wl.prompts[:8], params[:8], use_tqdm=False)  # warm
    runs = []
    for r in range(args.repeats):
        for arm in ARMS if r % 2 == 0 else reversed(ARMS):
            runs.append({"repeat": r, **run_arm(llm, arm, wl.prompts, params)})
            log.info("%s: %.0f tok/s, collector %.0f ms", arm, runs[-1]["output_tok_s"],
                     runs[-1]["collector_ms"])
    llm.close()
    medians = {arm: statistics.median(r["output_tok_s"] for r in runs if r["arm"] == arm)
               for arm in ARMS}
    collector = {arm: statistics.median(r["collector_ms"] for r in runs if r["arm"] == arm)
                 for arm in ARMS}
    line = (f"LLM.generate, {args.sim_model} on a simulated {args.sim_gpu}, {args.concurrency} "
            f"streams: raised thresholds {medians['raised']:.0f} tok/s (collector "
            f"{collector['raised']:.0f} ms), CPython's defaults {medians['defaults']:.0f} tok/s "
            f"(collector {collector['defaults']:.0f} ms): "
            f"{medians['raised'] / medians['defaults']:.2f}x (medians of {args.repeats})")
    return finish("gc_pauses", args, line, runs, model=args.model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="vocabulary and EOS")
    parser.add_argument("--sim-model", default="SmolLM2-1.7B")
    parser.add_argument("--sim-gpu", default="H100-SXM")
    parser.add_argument("--concurrency", type=int, default=256, help="max_num_seqs")
    parser.add_argument("--num-prompts", type=int, default=1024)
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=128)
    parser.add_argument("--min-output-len", type=int, default=32)
    parser.add_argument("--max-output-len", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=4, help="each arm's runs, alternated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="sim")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main()
