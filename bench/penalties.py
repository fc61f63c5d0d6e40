"""Penalties' cost per decode step: every penalized history counted from scratch each step
(`apply_penalties`, what the sampler did before) against counts kept from step to step
(`PenaltyCounts`), at steady batches where each sequence gains one token a step.

Per case it times, medians over --steps steps after a first one that counts every history:
  host_ms   the host's part that depends on the history: sending every history to the device
            (from scratch) against the kept counts' bookkeeping and new tokens (kept);
  step_ms   the whole penalty pass on --device, synchronized (on CPU the dense [rows, vocab]
            math is most of it, and both ways do it).
The two ways' logits are checked equal at every step.

    python -m bench.penalties
    python -m bench.penalties --device cuda --tag nvidia-h100
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
from types import SimpleNamespace

import torch
from pagedserve.worker_svc.host_to_device import to_device
from pagedserve.worker_svc.penalties import PenaltyCounts, apply_penalties

from bench.common import Timer, finish, sync_device

CASES = ((26, 1000, 151936), (256, 300, 49152), (8, 4000, 49152))  # rows, tokens, vocab


def _timed(fn, device: torch.device) -> tuple[float, object]:
    sync_device(device)
    with Timer() as timer:
        out = fn()
        sync_device(device)
    return timer.elapsed_s, out


def run_case(num_rows: int, num_tokens: int, vocab_size: int, steps: int,
             device: torch.device, rng: random.Random) -> dict:
    states = [SimpleNamespace(seq_id=i, token_ids=[rng.randrange(vocab_size)
                                                   for _ in range(num_tokens)],
                              prompt_len=num_tokens // 2) for i in range(num_rows)]
    params = ([1.1] * num_rows, [0.1] * num_rows, [0.1] * num_rows)
    logits = torch.randn(num_rows, vocab_size, device=device)
    counts = PenaltyCounts(vocab_size, device)
    counts.apply(logits.clone(), states, *params)
    times: dict[str, list[float]] = {"scratch_host": [], "kept_host": [], "scratch": [],
                                     "kept": []}
    for _ in range(steps):
        for state in states:
            state.token_ids.append(rng.randrange(vocab_size))
        times["scratch_host"].append(_timed(lambda: (to_device(list(
            itertools.chain.from_iterable(s.token_ids for s in states)), torch.long, device),
            to_device([len(s.token_ids) for s in states], torch.long, device)), device)[0])
        scratch_s, expected = _timed(lambda: apply_penalties(
            logits.clone(), [s.token_ids for s in states], [s.prompt_len for s in states],
            *params), device)
        kept_s, out = _timed(lambda: counts.apply(logits.clone(), states, *params), device)
        if not torch.equal(out, expected):
            raise RuntimeError("the kept counts' logits differ from counting from scratch")
        for state in states:  # the kept counts' host part alone: the next token, followed
            state.token_ids.append(rng.randrange(vocab_size))
        times["kept_host"].append(_timed(lambda: counts.follow(states), device)[0])
        times["scratch"].append(scratch_s)
        times["kept"].append(kept_s)
    ms = {name: statistics.median(values) * 1e3 for name, values in times.items()}
    return {"num_rows": num_rows, "num_tokens": num_tokens, "vocab_size": vocab_size,
            "host_ms": {"scratch": ms["scratch_host"], "kept": ms["kept_host"]},
            "step_ms": {"scratch": ms["scratch"], "kept": ms["kept"]},
            "kept_rows": counts.num_rows}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--cases", default=",".join(f"{r}x{t}x{v}" for r, t, v in CASES),
                        help="rows x history tokens x vocabulary, comma-separated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    rng = random.Random(args.seed)
    cases = [tuple(int(x) for x in case.split("x")) for case in args.cases.split(",")]
    results = [run_case(*case, args.steps, device, rng) for case in cases]
    line = f"penalties on {device.type}: " + "; ".join(
        f"{r['num_rows']} x {r['num_tokens']} tokens (vocab {r['vocab_size']}): host "
        f"{r['host_ms']['scratch']:.2f} -> {r['host_ms']['kept']:.2f} ms, step "
        f"{r['step_ms']['scratch']:.1f} -> {r['step_ms']['kept']:.1f} ms" for r in results)
    return finish("penalties", args, line, results)


if __name__ == "__main__":
    main()
