"""Draft-model speculative decoding on a modelled GPU: the speed-up the roofline of the simulated
worker (worker_svc/sim/roofline.py) gives Llama-3-8B with a Llama-3.2-1B draft, at batch 1 and
32, for a range of acceptance rates (an acceptance rate is the workload's and the draft's, not
the GPU's: it is an input here, not a result).

A speculating step is what the worker runs: the draft model's forward over each sequence's new
token(s) (one, two after a step that kept every draft), k - 1 more draft forwards of one token
each, then the target's forward over 1 + k tokens per sequence with 1 + k logits rows. With a
per-draft acceptance rate a a sequence keeps (1 - a^(k+1)) / (1 - a) tokens per step. Each
forward pays the roofline plus sim_launch_overhead_us (the draft forwards run eagerly, the same
overhead is assumed for the graphs' replay). Record: bench/results/spec_decode_model-<tag>.json.

    python -m bench.spec_decode_model
"""

from __future__ import annotations

import argparse

from pagedserve.services.common.config import DeviceConfig
from pagedserve.worker_svc.sim.roofline import Roofline, resolve_gpu, resolve_model_shape

from bench.common import finish


def kept_per_step(acceptance: float, k: int) -> float:
    return float(k + 1) if acceptance >= 1 else (1 - acceptance ** (k + 1)) / (1 - acceptance)


def speed_up(target: Roofline, draft: Roofline, batch: int, context: int, k: int,
             acceptance: float) -> float:
    plain = target.step([1] * batch, [context] * batch, batch).time_s
    all_kept = acceptance ** k  # then the draft model also computes the last draft
    draft_s = sum(p * draft.step([n] * batch, [context] * batch, batch).time_s
                  for n, p in ((1, 1 - all_kept), (2, all_kept)))
    draft_s += (k - 1) * draft.step([1] * batch, [context + 1] * batch, batch).time_s
    verify_s = target.step([1 + k] * batch, [context] * batch, batch * (1 + k)).time_s
    return kept_per_step(acceptance, k) / ((draft_s + verify_s) / plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="Llama-3-8B")
    parser.add_argument("--draft", default="Llama-3.2-1B")
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--context", type=int, default=1024, help="tokens before each step")
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.6, 0.7, 0.8])
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--tag", default="h100")
    args = parser.parse_args()
    device = DeviceConfig()
    gpu = resolve_gpu(args.gpu)
    target, draft = (Roofline(resolve_model_shape(name), gpu, 2, device.sim_flops_efficiency,
                              device.sim_bandwidth_efficiency,
                              device.sim_launch_overhead_us * 1e-6)
                     for name in (args.target, args.draft))
    results = []
    for batch in (1, 32):
        for acceptance in args.acceptance:
            by_k = {k: speed_up(target, draft, batch, args.context, k, acceptance)
                    for k in range(1, args.max_k + 1)}
            best = max(by_k, key=by_k.get)
            results.append({"batch": batch, "acceptance_rate": acceptance, "best_k": best,
                            "speed_up": round(by_k[best], 3),
                            "speed_up_by_k": {k: round(v, 3) for k, v in by_k.items()}})
    line = "spec_decode_model: " + ", ".join(
        f"b{r['batch']} a={r['acceptance_rate']} {r['speed_up']:.2f}x (k={r['best_k']})"
        for r in results)
    finish("spec_decode_model", args, line, results)


if __name__ == "__main__":
    main()
