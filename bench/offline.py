"""Offline throughput: pagedserve's LLM.generate against HF transformers generate, same run.

Baselines, on the same prompts and output lengths (greedy, ignore_eos, fp32):
  - HF sequential: one request at a time;
  - HF padded: static left-padded batches of --batch-size requests (pagedserve runs at most
    that many at once too), each generating as many tokens as its longest request -- what a
    static batcher must do -- with only the requested tokens counted.
Three workloads, 32 prompts each by default: "mixed" (prompts of 32-256 tokens, 32-128 output
tokens) and "uniform" (128 -> 64), both within ~10 minutes on 2 cores, most of it HF sequential;
and "long" (prompts of 32-512 tokens, 32-256 output tokens, static batches of --long-batch-size),
where decode attention reads long contexts: ~15 more minutes, run it with `--workloads long`.
Reports output tokens/s and each ratio against its target; the record goes to
bench/results/offline-<tag>.json.

    python -m bench.offline                      # defaults: the sizes `make bench` runs
    python -m bench.offline --num-prompts 8 --max-output-len 32 --tag smoke
"""

from __future__ import annotations

import argparse
import logging

import torch
import transformers

from bench.common import (
    DEFAULT_MODEL,
    Timer,
    Workload,
    finish,
    hf_generate,
    make_workload,
    quiet_logging,
)
from pagedserve.llm import LLM

log = logging.getLogger("bench.offline")

TARGETS = {"mixed": {"ratio_vs_hf_sequential": 5.0, "ratio_vs_hf_padded": 1.3},
           "uniform": {"ratio_vs_hf_padded": 0.9},
           "long": {"ratio_vs_hf_sequential": 6.0, "ratio_vs_hf_padded": 1.8}}
SEQUENTIAL_WORKLOADS = ("mixed", "long")


def run_pagedserve(llm: LLM, wl: Workload) -> tuple[float, list[list[int]]]:
    with Timer() as t:
        outs = llm.generate(wl.prompts, wl.sampling_params(), use_tqdm=False)
    token_ids = [o.outputs[0].token_ids for o in outs]
    if [len(ids) for ids in token_ids] != wl.output_lens:
        raise RuntimeError("pagedserve generated other lengths than asked")
    return t.elapsed_s, token_ids


def run_hf_sequential(model, wl: Workload) -> tuple[float, list[list[int]]]:
    outputs = []
    with Timer() as t:
        for prompt, n in zip(wl.prompts, wl.output_lens, strict=True):
            outputs.append(hf_generate(model, [prompt], n)[0].tolist())
    return t.elapsed_s, outputs


def run_hf_padded(model, wl: Workload, batch_size: int) -> float:
    with Timer() as t:
        for start in range(0, len(wl.prompts), batch_size):
            stop = start + batch_size
            hf_generate(model, wl.prompts[start:stop], max(wl.output_lens[start:stop]))
    return t.elapsed_s


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    """How far greedy outputs agree: whole outputs equal, and the mean common-prefix fraction
    (fp32 summation order differs between batched kernels, so a near-tie may flip late)."""
    prefixes = []
    for a, b in zip(ours, theirs, strict=True):
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        prefixes.append(n / max(len(a), 1))
    return {"num_equal": sum(a == b for a, b in zip(ours, theirs, strict=True)),
            "num_outputs": len(ours), "mean_common_prefix": sum(prefixes) / len(prefixes)}


def bench_workload(llm: LLM, hf, wl: Workload, batch_size: int, sequential: bool,
                   repeats: int) -> dict:
    """pagedserve and HF padded alternate `repeats` times and each keeps its fastest run: on a
    shared machine, interference only ever adds time. HF sequential runs once."""
    log.info("%s: %d prompts, %d prompt tokens, %d output tokens", wl.name, len(wl.prompts),
             wl.num_prompt_tokens, wl.num_output_tokens)
    num_preemptions = llm.engine.get_load().num_preemptions
    ours_runs, padded_runs = [], []
    for _ in range(repeats):
        ours_s, ours_tokens = run_pagedserve(llm, wl)
        padded_s = run_hf_padded(hf, wl, batch_size)
        log.info("%s: pagedserve %.1f s, HF padded %.1f s", wl.name, ours_s, padded_s)
        ours_runs.append(ours_s)
        padded_runs.append(padded_s)
    ours_s, padded_s = min(ours_runs), min(padded_runs)
    result = {**wl.describe(), "batch_size": batch_size, "pagedserve_s": ours_s,
              "pagedserve_runs_s": ours_runs, "pagedserve_tok_s": wl.num_output_tokens / ours_s,
              "pagedserve_preemptions": llm.engine.get_load().num_preemptions - num_preemptions,
              "hf_padded_s": padded_s, "hf_padded_runs_s": padded_runs,
              "hf_padded_tok_s": wl.num_output_tokens / padded_s,
              "ratio_vs_hf_padded": padded_s / ours_s}
    if sequential:
        seq_s, hf_tokens = run_hf_sequential(hf, wl)
        log.info("%s: HF sequential %.1f s", wl.name, seq_s)
        result.update(hf_sequential_s=seq_s, hf_sequential_tok_s=wl.num_output_tokens / seq_s,
                      ratio_vs_hf_sequential=seq_s / ours_s,
                      greedy_agreement_with_hf=agreement(ours_tokens, hf_tokens))
    result["targets"] = {name: {"target": target, "met": result[name] >= target}
                         for name, target in TARGETS[wl.name].items() if name in result}
    return result


def summary(results: list[dict]) -> str:
    parts = []
    for r in results:
        ratios = ", ".join(f"{r[name]:.2f}x {name.removeprefix('ratio_vs_').replace('_', ' ')}"
                           f" (target {t['target']}x{'' if t['met'] else ' MISSED'})"
                           for name, t in r["targets"].items())
        parts.append(f"{r['workload']} {r['pagedserve_tok_s']:.1f} tok/s = {ratios}")
    return "offline: " + "; ".join(parts)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32,
                        help="pagedserve's max_num_seqs and the HF static batch size")
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=256)
    parser.add_argument("--min-output-len", type=int, default=32)
    parser.add_argument("--max-output-len", type=int, default=128)
    parser.add_argument("--uniform-prompt-len", type=int, default=128)
    parser.add_argument("--uniform-output-len", type=int, default=64)
    parser.add_argument("--long-min-prompt-len", type=int, default=32)
    parser.add_argument("--long-max-prompt-len", type=int, default=512)
    parser.add_argument("--long-min-output-len", type=int, default=32)
    parser.add_argument("--long-max-output-len", type=int, default=256)
    parser.add_argument("--long-batch-size", type=int, default=16,
                        help="max_num_seqs and the HF static batch size of the long workload")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs of pagedserve and HF padded each (the fastest counts)")
    parser.add_argument("--skip-sequential", action="store_true",
                        help="skip the slow one-at-a-time HF baseline")
    parser.add_argument("--workloads", nargs="+", default=["mixed", "uniform"],
                        choices=list(TARGETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    return parser.parse_args(argv)


def start_llm(args: argparse.Namespace, max_num_seqs: int, vocab: int) -> LLM:
    llm = LLM(model=args.model, dtype="float32", max_num_seqs=max_num_seqs,
              kv_cache_memory_gib=args.kv_cache_memory_gib, swap_space_gib=0.25, seed=args.seed)
    run_pagedserve(llm, make_workload("warmup", 4, (16, 64), (8, 8), vocab, seed=args.seed + 1))
    return llm


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    torch.manual_seed(args.seed)

    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    vocab = hf.config.vocab_size
    run_hf_padded(hf, make_workload("warmup", 4, (16, 64), (8, 8), vocab, seed=args.seed + 1), 4)
    run_hf_sequential(hf, make_workload("warmup", 1, (16, 16), (4, 4), vocab, args.seed + 1))

    workloads = {
        "mixed": make_workload("mixed", args.num_prompts, (args.min_prompt_len, args.max_prompt_len),
                               (args.min_output_len, args.max_output_len), vocab, args.seed),
        "uniform": make_workload("uniform", args.num_prompts, (args.uniform_prompt_len,) * 2,
                                 (args.uniform_output_len,) * 2, vocab, args.seed),
        "long": make_workload("long", args.num_prompts,
                              (args.long_min_prompt_len, args.long_max_prompt_len),
                              (args.long_min_output_len, args.long_max_output_len), vocab,
                              args.seed),
    }
    batch_sizes = {"mixed": args.batch_size, "uniform": args.batch_size,
                   "long": args.long_batch_size}
    results, llm, llm_batch_size = [], None, None
    for name in args.workloads:
        batch_size = batch_sizes[name]
        if batch_size != llm_batch_size:  # pagedserve runs at most the HF batch at once
            if llm is not None:
                llm.close()
            llm, llm_batch_size = start_llm(args, batch_size, vocab), batch_size
        results.append(bench_workload(
            llm, hf, workloads[name], batch_size,
            sequential=name in SEQUENTIAL_WORKLOADS and not args.skip_sequential,
            repeats=args.repeats))
    llm.close()
    line = summary(results)
    return finish("offline", args, line, results, model=args.model, dtype="float32")


if __name__ == "__main__":
    main()
