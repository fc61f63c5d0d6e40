"""The most n-gram prompt lookup can give on bench.spec_decode's workloads: steps per output token
with a verifier that is free and a proposer that always proposes (no back-off, no budget).

Each prompt's greedy output is generated once with speculation off; it is then replayed through
the scheduler's proposer (scheduler_svc/ngram_proposer.py): a step proposes up to k tokens from
the prompt and the output so far, keeps the prefix that equals the output, and adds one token.
The record holds, per workload and (k, prompt_lookup_min, prompt_lookup_max_spec_factor), the
steps, the output tokens per step and the drafts verified and rejected, against which the
engine's own steps and bench.spec_decode's speed-ups can be read: with a step costing the same
with drafts as without, the decode is sped up by exactly the tokens per step; a rejected draft
is a row verified for nothing. Record: bench/results/ngram_ceiling-<tag>.json.

    python -m bench.ngram_ceiling
"""

from __future__ import annotations

import argparse
from typing import NamedTuple

from pagedserve.scheduler_svc.ngram_proposer import propose_ngram
from pagedserve.services.common.sampling_params import SamplingParams

from bench.common import DEFAULT_MODEL, finish, quiet_logging
from bench.spec_decode import prompts
from pagedserve.llm import LLM


class Replay(NamedTuple):
    num_steps: int
    num_draft_tokens: int  # verified rows beyond each step's own token
    num_accepted_tokens: int


def replay_steps(prompt: list[int], output: list[int], num_tokens: int, min_n: int,
                 max_n: int, spec_factor: float = 0.0) -> Replay:
    """The steps to produce `output` after `prompt` when every step verifies the proposal."""
    pos = steps = num_drafts = num_accepted = 0
    while pos < len(output):
        drafts = propose_ngram(prompt + output[:pos], min(num_tokens, len(output) - pos - 1),
                               min_n, max_n, spec_factor)
        kept = 0
        for draft, token in zip(drafts, output[pos:], strict=False):
            if draft != token:
                break
            kept += 1
        pos += kept + 1
        steps += 1
        num_drafts += len(drafts)
        num_accepted += kept
    return Replay(steps, num_drafts, num_accepted)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--num-speculative-tokens", type=int, nargs="+", default=[4, 6, 8, 12])
    parser.add_argument("--prompt-lookup-min", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--prompt-lookup-max-spec-factor", type=float, nargs="+",
                        default=[0.0, 1.0, 2.0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args()
    quiet_logging()
    llm = LLM(args.model, device="cpu", max_num_seqs=8, kv_cache_memory_gib=0.25)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    results = []
    for workload in ("grounded", "chat"):
        batch = prompts(llm, workload, args.num_prompts, args.seed)
        outputs = [o.outputs[0].token_ids for o in llm.generate(batch, sampling, use_tqdm=False)]
        num_tokens = sum(map(len, outputs))
        for k in args.num_speculative_tokens:
            for min_n in args.prompt_lookup_min:
                for factor in args.prompt_lookup_max_spec_factor:
                    replays = [replay_steps(p, o, k, min_n, args.prompt_lookup_max, factor)
                               for p, o in zip(batch, outputs, strict=True)]
                    steps = sum(r.num_steps for r in replays)
                    num_drafts = sum(r.num_draft_tokens for r in replays)
                    results.append({
                        "workload": workload, "num_speculative_tokens": k,
                        "prompt_lookup_min": min_n, "prompt_lookup_max_spec_factor": factor,
                        "num_output_tokens": num_tokens, "steps": steps,
                        "steps_per_prompt": [r.num_steps for r in replays],
                        "tokens_per_step": round(num_tokens / steps, 3),
                        "num_draft_tokens": num_drafts,
                        "num_rejected_tokens":
                            num_drafts - sum(r.num_accepted_tokens for r in replays)})
    line = "ngram_ceiling: " + ", ".join(
        f"{r['workload']} k={r['num_speculative_tokens']} min={r['prompt_lookup_min']} "
        f"f={r['prompt_lookup_max_spec_factor']:g} {r['tokens_per_step']:.2f} tok/step "
        f"({r['num_rejected_tokens']}/{r['num_draft_tokens']} rejected)" for r in results)
    finish("ngram_ceiling", args, line, results)


if __name__ == "__main__":
    main()
