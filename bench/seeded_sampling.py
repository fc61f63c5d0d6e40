"""The sampler's seeded draws against its unseeded ones (the global RNG's one exponential_ for
every row), on this host's CPU: `Sampler.__call__` at --batch-sizes rows of a --vocab-size
vocabulary, temperature 1, one draw a row, the median of --repeats after a warm-up.
Record: bench/results/seeded_sampling[-<tag>].json.

    python -m bench.seeded_sampling --tag <branch>
"""

from __future__ import annotations

import argparse
import statistics

import torch
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState

from bench.common import Timer, finish


def time_ms(sampler: Sampler, logits: torch.Tensor, rows: list[SeqSamplingState],
            repeats: int) -> float:
    sampler(logits, rows)  # warm-up
    times = []
    for _ in range(repeats):
        with Timer() as timer:
            sampler(logits, rows)
        times.append(timer.elapsed_s * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32, 256])
    parser.add_argument("--vocab-size", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    sampler = Sampler(args.vocab_size, [], torch.device("cpu"))
    results = []
    for batch_size in args.batch_sizes:
        logits = torch.randn(batch_size, args.vocab_size)
        timings = {}
        for kind, seed in (("unseeded", None), ("seeded", args.seed)):
            rows = [SeqSamplingState(seq_id=i, sampling=SamplingParams(), token_ids=[1, 2, 3],
                                     prompt_len=3, seed=None if seed is None else seed + i,
                                     num_samples=1) for i in range(batch_size)]
            timings[f"{kind}_ms"] = time_ms(sampler, logits, rows, args.repeats)
        results.append({"batch_size": batch_size, **timings,
                        "seeded_over_unseeded": timings["seeded_ms"] / timings["unseeded_ms"]})
    line = "seeded_sampling (vocab {}): {}".format(args.vocab_size, ", ".join(
        f"batch {r['batch_size']} seeded {r['seeded_ms']:.2f} ms = "
        f"{r['seeded_over_unseeded']:.2f}x unseeded" for r in results))
    finish("seeded_sampling", args, line, results)


if __name__ == "__main__":
    main()
