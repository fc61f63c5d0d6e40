"""Speculative decoding (n-gram prompt lookup) against speculation off, same run, SmolLM2 on CPU.

Two workloads, seeded: "grounded" asks the model to repeat, rewrite, extract from or continue a
passage that is in the prompt (paragraphs of this repository's docs, in
bench/spec_decode_passages.txt), where the output echoes the
input and lookups find it; "chat" asks open-ended questions, where they rarely do. Each runs at
batch 1 (one prompt at a time) and batch 8, greedy, stopping at EOS or --max-tokens, speculation
off and on alternating (each prompt at batch 1, each batch at 8) so that a busy machine slows
both alike, --repeats times. `--continuous` runs batch 8 as `LLM.generate` of all the prompts
with 8 in flight (continuous batching: the next prompt is admitted as one ends, so the run is not
as long as its slowest request of 8; off and on then alternate whole runs). The record holds
output tokens/s with speculation off and on, their ratio against the issue's target (grounded:
>= 2.0x at batch 1, >= 1.4x at batch 8; chat: >= 0.95x), whether the outputs were identical, and
the acceptance counters. Record: bench/results/spec_decode-<tag>.json.

    python -m bench.spec_decode
    python -m bench.spec_decode --max-tokens 32 --tag smoke
    python -m bench.spec_decode --batches 8 --continuous --num-prompts 24 --tag continuous
"""

from __future__ import annotations

import argparse
import json
import logging
import random
from pathlib import Path

from pagedserve.services.common.sampling_params import SamplingParams

from bench.common import DEFAULT_MODEL, Timer, finish, quiet_logging
from pagedserve.llm import LLM

log = logging.getLogger("bench.spec_decode")

TARGETS = {("grounded", 1): 2.0, ("grounded", 8): 1.4, ("chat", 1): 0.95, ("chat", 8): 0.95}
GROUNDED_TASKS = [
    "Repeat the following text exactly, word for word:\n\n{passage}",
    "Rewrite the following text, keeping its wording but fixing any mistakes:\n\n{passage}",
    "Copy out every sentence of the following text that mentions a block or a request:\n\n"
    "{passage}",
    "Continue this text, first repeating its last paragraph:\n\n{passage}",
]
CHAT_QUESTIONS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying healthy while working from home?",
    "Explain why the sky is blue to a ten-year-old.",
    "Give me three ideas for a birthday party for my grandmother.",
    "What is the difference between weather and climate?",
    "Describe your ideal weekend in a few sentences.",
    "How do airplanes stay in the air?",
    "Suggest a name for a coffee shop and explain the choice.",
]


def passages(seed: int, count: int) -> list[str]:
    """Prose paragraphs (40 to 120 words, from this repository's docs when the bench was written,
    kept fixed in spec_decode_passages.txt), chosen by the seed."""
    text = (Path(__file__).parent / "spec_decode_passages.txt").read_text()
    return random.Random(seed).sample(text.strip().split("\n\n"), count)


def prompts(llm: LLM, workload: str, count: int, seed: int) -> list[list[int]]:
    if workload == "grounded":
        texts = [GROUNDED_TASKS[i % len(GROUNDED_TASKS)].format(passage=p)
                 for i, p in enumerate(passages(seed, count))]
    else:
        texts = [CHAT_QUESTIONS[i % len(CHAT_QUESTIONS)] for i in range(count)]
    return [llm.tokenizer.apply_chat_template([{"role": "user", "content": t}]) for t in texts]


def timed(llm: LLM, batch: list[list[int]], sampling: SamplingParams) -> tuple[list, float]:
    with Timer() as timer:
        outputs = llm.generate(batch, sampling, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], timer.elapsed_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--speculative-config", default=json.dumps(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
         "prompt_lookup_min": 2}))
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=8,
                        help="per workload and batch size (at most 24)")
    parser.add_argument("--batches", type=int, nargs="+", choices=(1, 8), default=[1, 8])
    parser.add_argument("--continuous", action="store_true",
                        help="batch 8: every prompt in one generate, 8 in flight, the next "
                             "admitted as one ends (closed batches of 8 without it)")
    parser.add_argument("--num-threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    quiet_logging()
    off, on = (LLM(args.model, device="cpu", num_threads=args.num_threads, max_num_seqs=8,
                   speculative_config=spec, kv_cache_memory_gib=0.25)
               for spec in ("", args.speculative_config))
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in (off, on):
        llm.generate([prompts(off, "chat", 1, 0)[0]], SamplingParams(max_tokens=4),
                     use_tqdm=False)
    speculator = on.engine.core.scheduler.speculator
    results = []
    for workload in ("grounded", "chat"):
        batch_prompts = prompts(off, workload, args.num_prompts, args.seed)
        for batch in args.batches:
            before = (speculator.totals.num_draft_tokens, speculator.totals.num_accepted_tokens,
                      speculator.totals.num_drafts)
            off_tokens, on_tokens, off_s, on_s = [], [], 0.0, 0.0
            step = len(batch_prompts) if batch > 1 and args.continuous else batch
            for _ in range(args.repeats):
                off_tokens, on_tokens = [], []
                for start in range(0, len(batch_prompts), step):
                    chunk = batch_prompts[start:start + step]
                    tokens, seconds = timed(off, chunk, sampling)
                    off_tokens += tokens
                    off_s += seconds
                    tokens, seconds = timed(on, chunk, sampling)
                    on_tokens += tokens
                    on_s += seconds
            num_tokens = sum(map(len, off_tokens)) * args.repeats
            totals = speculator.totals
            num_draft_tokens = totals.num_draft_tokens - before[0]
            num_accepted = totals.num_accepted_tokens - before[1]
            num_drafts = totals.num_drafts - before[2]
            ratio = (sum(map(len, on_tokens)) * args.repeats / on_s) / (num_tokens / off_s)
            result = {
                "workload": workload, "batch": batch, "num_prompts": len(batch_prompts),
                "continuous": step > batch,
                "num_output_tokens": num_tokens,
                "off_tokens_per_s": round(num_tokens / off_s, 2),
                "on_tokens_per_s": round(sum(map(len, on_tokens)) * args.repeats / on_s, 2),
                "ratio": round(ratio, 3), "target": TARGETS[(workload, batch)],
                "meets_target": ratio >= TARGETS[(workload, batch)],
                "identical_outputs": on_tokens == off_tokens,
                "num_drafts": num_drafts, "num_draft_tokens": num_draft_tokens,
                "num_accepted_tokens": num_accepted,
                "acceptance_rate": round(num_accepted / num_draft_tokens, 3)
                if num_draft_tokens else None,
                "mean_accepted_length": round(num_accepted / num_drafts, 3)
                if num_drafts else None}
            log.info("%s", result)
            results.append(result)
    line = "spec_decode: " + ", ".join(
        f"{r['workload']}@{r['batch']} {r['ratio']:.2f}x (target {r['target']}x"
        f"{'' if r['meets_target'] else ', MISSED'}"
        f"{'' if r['identical_outputs'] else ', OUTPUTS DIFFER'})" for r in results)
    finish("spec_decode", args, line, results)


if __name__ == "__main__":
    main()
