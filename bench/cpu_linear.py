"""A decode step's linear layers on CPU, fp32 or bf16 (--dtype): `F.linear` (BLAS, or oneDNN
for bf16) against the skinny kernel (`kernels/cpu_linear.py`) at each of --rows rows, for the
weights of one model shape: every layer's QKV, output, gate-up and down projections and the LM
head, each fed a fresh input as a step feeds it. The two ways alternate (A B, then B A), --repeats times each; per way, the min
and median ms of one step's linears. The outputs are checked close once per shape.

    python -m bench.cpu_linear
    python -m bench.cpu_linear --rows 1 2 8 --threads 1
    python -m bench.cpu_linear --dtype bfloat16 --tag cpu-bf16
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F
from pagedserve.kernels import cpu_linear

from bench.common import Timer, finish, quiet_logging

# hidden, intermediate, layers, q heads, kv heads, head size, vocab (SmolLM2-135M by default)
SHAPES = {"smollm2-135m": (576, 1536, 30, 9, 3, 64, 49152),
          "smollm2-360m": (960, 2560, 32, 15, 5, 64, 49152)}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def step_weights(shape: str, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    hidden, inter, layers, heads, kv_heads, head_size, vocab = SHAPES[shape]
    gen = torch.Generator().manual_seed(0)
    per_layer = [((heads + 2 * kv_heads) * head_size, hidden), (hidden, heads * head_size),
                 (2 * inter, hidden), (hidden, inter)]
    return [torch.randn(out, inp, generator=gen).to(dtype) for _ in range(layers)
            for out, inp in per_layer] + [torch.randn(vocab, hidden, generator=gen).to(dtype)]


def _skinny(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    out = x.new_empty(x.shape[0], weight.shape[0])
    cpu_linear.load().skinny_linear(out, x, weight)
    return out


def time_step(way, weights: list[torch.Tensor], inputs: list[torch.Tensor]) -> float:
    with Timer() as timer:
        for x, weight in zip(inputs, weights, strict=True):
            way(x, weight)
    return timer.elapsed_s


def run_rows(num_rows: int, weights: list[torch.Tensor], repeats: int) -> dict:
    gen = torch.Generator().manual_seed(num_rows)
    inputs = [torch.randn(num_rows, w.shape[1], generator=gen).to(w.dtype) for w in weights]
    tolerance = {} if weights[0].dtype == torch.bfloat16 else {"rtol": 1e-4, "atol": 1e-3}
    for x, weight in zip(inputs[:5], weights[:5], strict=True):
        torch.testing.assert_close(_skinny(x, weight), F.linear(x, weight), **tolerance)
    ways = {"blas": F.linear, "skinny": _skinny}
    for way in ways.values():  # warm-up
        time_step(way, weights, inputs)
    times: dict[str, list[float]] = {name: [] for name in ways}
    for r in range(repeats):
        for name in (ways if r % 2 == 0 else reversed(ways)):
            times[name].append(1e3 * time_step(ways[name], weights, inputs))
    return {"rows": num_rows,
            **{f"{name}_ms": {"min": min(ms), "median": statistics.median(ms), "all": ms}
               for name, ms in times.items()}}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--repeats", type=int, default=15, help="steps timed per way and rows")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = default")
    parser.add_argument("--note", default="")
    parser.add_argument("--tag", default="cpu")
    args = parser.parse_args(argv)
    quiet_logging()
    if cpu_linear.load() is None:
        raise SystemExit("the skinny kernel is not built on this host (no compiler or AVX-512)")
    if DTYPES[args.dtype] not in cpu_linear.max_rows():
        raise SystemExit(f"the skinny kernel takes no {args.dtype} on this host (no AVX512-BF16)")
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = step_weights(args.shape, DTYPES[args.dtype])
    with torch.inference_mode():
        results = [run_rows(n, weights, args.repeats) for n in args.rows]
    line = (f"cpu_linear: {args.shape} {args.dtype}, {torch.get_num_threads()} threads, "
            "a step's linears ") + (
        "; ".join(f"{r['rows']} rows {r['blas_ms']['median']:.1f} (BLAS) / "
                  f"{r['skinny_ms']['median']:.1f} ms (skinny)" for r in results))
    return finish("cpu_linear", args, line, results, note=args.note,
                  num_threads=torch.get_num_threads())


if __name__ == "__main__":
    main()
