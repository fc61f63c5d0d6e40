"""Draft-model speculative decoding run by the engine on the simulated GPU: Llama-3-8B with a
Llama-3.2-1B draft on a simulated H100, at batch 1 and 32, speculation off and on, same prompts.

The simulated worker runs the real proposer's bookkeeping, the scheduler's lookahead and draft
budget, and the verification; each forward (the draft's catch-up and proposing forwards, the
target's verification) takes the modelled time of its kernels, graphs where the real runner
replays them, and the proposer waits for each draft forward as the real one reads its drafts on
the host. Simulated tokens mean nothing, so each draft is the target's next token with
probability --acceptance (an input: the workload's and the draft's, worker_svc/sim/
draft_proposer.py). Next to each result: bench/spec_decode_model.py's roofline estimate for the
same rate and k, which has no host, no launches and no syncs. Figures are a model, not a
measurement. Record: bench/results/spec_decode_sim-<tag>.json.

    python -m bench.spec_decode_sim
    python -m bench.spec_decode_sim --batch-sizes 1 --acceptance 0.7 --output-len 32 --tag smoke
"""

from __future__ import annotations

import argparse
import json
import time

from pagedserve.services.common.config import DeviceConfig
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.worker_svc.sim.roofline import Roofline, resolve_gpu, resolve_model_shape

from bench.common import DEFAULT_MODEL, finish, quiet_logging
from bench.spec_decode_model import speed_up
from pagedserve.llm_engine import LLMEngine


def run(args: argparse.Namespace, batch: int, acceptance: float | None) -> dict:
    """acceptance None: speculation off."""
    options = dict(model=args.model, device="sim", sim_model=args.target, sim_gpu=args.gpu,
                   dtype="bfloat16")
    if acceptance is not None:
        options.update(sim_draft_acceptance=acceptance, speculative_config=json.dumps(
            {"method": "draft_model", "model": args.draft, "num_speculative_tokens": args.k}))
    engine = LLMEngine.from_kwargs(**options)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [1000 + (997 * i + j) % 30000
                                     for j in range(args.prompt_len)], sampling)
    engine.step()  # the prompts
    num_tokens, num_steps, start = 0, 0, time.perf_counter()
    while engine.has_unfinished_requests():
        num_tokens += sum(len(o.token_ids) for r in engine.step() for o in r.outputs)
        num_steps += 1
    seconds = time.perf_counter() - start
    result = {"output_tok_s": round(num_tokens / seconds, 1), "num_steps": num_steps}
    if acceptance is not None:
        totals = engine.core.scheduler.speculator.totals
        result.update(num_draft_tokens=totals.num_draft_tokens,
                      num_accepted_tokens=totals.num_accepted_tokens)
    engine.close()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL, help="the served folder (tokenizer)")
    parser.add_argument("--target", default="Llama-3-8B")
    parser.add_argument("--draft", default="Llama-3.2-1B")
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--acceptance", type=float, nargs="+", default=[0.5, 0.7, 0.8])
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--tag", default="h100")
    args = parser.parse_args()
    quiet_logging()
    device, gpu = DeviceConfig(), resolve_gpu(args.gpu)
    target, draft = (Roofline(resolve_model_shape(name), gpu, 2, device.sim_flops_efficiency,
                              device.sim_bandwidth_efficiency,
                              device.sim_launch_overhead_us * 1e-6)
                     for name in (args.target, args.draft))
    results = []
    for batch in args.batch_sizes:
        off = run(args, batch, None)
        for acceptance in args.acceptance:
            on = run(args, batch, acceptance)
            results.append({
                "batch": batch, "acceptance_rate": acceptance, "off": off, "on": on,
                "speed_up": round(on["output_tok_s"] / off["output_tok_s"], 3),
                "roofline_speed_up": round(speed_up(target, draft, batch, args.prompt_len,
                                                    args.k, acceptance), 3)})
    line = (f"spec_decode_sim ({args.target} + {args.draft} draft on a simulated {gpu.name}, "
            f"k={args.k}; a model, not a measurement): " + ", ".join(
                f"b{r['batch']} a={r['acceptance_rate']} {r['speed_up']:.2f}x "
                f"(roofline {r['roofline_speed_up']:.2f}x)" for r in results))
    finish("spec_decode_sim", args, line, results)


if __name__ == "__main__":
    main()
