"""The simulated H100 against a GPU run's records: per record, each figure both have, modelled
with the previous fit and with the refit, and the refit itself.

The GPU run's records are bench/results/*-nvidia-h100-80gb-hbm3-47d62ba*.json (bench.gpu_check
on one H100 80GB HBM3, code 47d62ba, the morning of 2026-11-27; kept under that name when later
runs took the device's own). The fit has two free constants, each fitted to one Llama-3-8B record and
checked against the Qwen2.5-0.5B record of the same bench, which it never saw:
  - the fused layer kernels' fixed cost (worker_svc/sim/calibration.py): the median decode
    step's forward, modelled at the record's median batch and context with graphs, through the
    float32 logits (a GPU worker's timed forward; the sampler is timed apart);
  - HF's host time per launch (bench/hf_sim.py): HF generate's padded batches.
Figures of a whole simulated run (its tokens/s, wall times) come from the sim records of
bench.offline_gpu, bench.serving and bench.step_graphs, the previous ones and those rerun after
the refit (tag sim-calib-<model>); their wall times are this machine's host, not the GPU's, and
are marked so.

    python -m bench.calibration        # writes bench/results/calibration-2026-11-27-h100.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from pagedserve.worker_svc.cuda_graphs import MAX_CAPTURE_SEQ_LEN
from pagedserve.worker_svc.graph_buckets import capture_buckets
from pagedserve.worker_svc.sim.calibration import (
    H100_2026_11_26,
    H100_CALIBRATION,
    Calibration,
    with_fused_fixed_s,
)
from pagedserve.worker_svc.sim.roofline import GPUS, ModelShape, Roofline
from pagedserve.worker_svc.sim.step_model import DECODE_PARTITION_SIZE, AffineOps, StepModel
from pagedserve.worker_svc.sim.trace import MetaModel

from bench.common import RESULTS_DIR, finish, make_workload
from bench.hf_sim import HF_LAUNCH_S, HF_LAUNCH_S_2026_11_26, SimulatedHF
from bench.offline_gpu import MODEL_CONFIGS

RUN = "2026-11-27-h100"
DEVICE_TAG = "nvidia-h100-80gb-hbm3-47d62ba"  # the records the constants were fitted to
H100 = GPUS["H100-SXM"]
FIT_MODEL, HELD_OUT_MODEL = "llama-3-8b", "qwen2.5-0.5b"
BEFORE, AFTER = (H100_2026_11_26, HF_LAUNCH_S_2026_11_26), (H100_CALIBRATION, HF_LAUNCH_S)
_MIXED_GRAPH_TOKENS = 512  # the engine's default max_cuda_graph_tokens


def load_record(name: str, results_dir: Path = RESULTS_DIR) -> dict:
    return json.loads((results_dir / f"{name}.json").read_text())


def offline_record(model: str, results_dir: Path = RESULTS_DIR) -> dict:
    return load_record(f"offline_gpu-{DEVICE_TAG}-{model}", results_dir)


@dataclass(frozen=True, slots=True)
class DecodePoint:
    """A record's median decode step: its batch and each sequence's context (from the median
    step's bytes: the record keeps medians only, so this is the typical step, not one step)."""

    model: str
    batch: int
    context: int
    max_num_seqs: int
    measured_forward_s: float
    weight_bytes: int

    @classmethod
    def of(cls, record: dict) -> DecodePoint:
        result = record["results"][0]
        decode = result["decode"]
        shape = model_shape(result["model"])
        forward_s = decode["median_forward_ms"] * 1e-3
        kv_bytes = decode["median_forward_gbps"] * 1e9 * forward_s - result["weight_bytes"]
        batch = round(decode["median_batch_size"])
        context = round(kv_bytes / shape.kv_bytes_per_token(2) / batch)
        return cls(result["model"], batch, context, result["batch_size"], forward_s,
                   result["weight_bytes"])

    def mbu(self, forward_s: float) -> float:
        kv_bytes = self.batch * self.context * model_shape(self.model).kv_bytes_per_token(2)
        return (self.weight_bytes + kv_bytes) / forward_s / H100.memory_bandwidth


def model_shape(model: str) -> ModelShape:
    return ModelShape.from_hf_config(model, MODEL_CONFIGS[model])


def hf_config(model: str) -> transformers.PretrainedConfig:
    config = MODEL_CONFIGS[model]
    return transformers.AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"},
        architectures=config["architectures"])


_OPS: dict[str, tuple[AffineOps, AffineOps]] = {}


def forward_ops(model: str) -> tuple[AffineOps, AffineOps]:
    """The fused-kernel forward and the logits without the sampler, as a GPU worker times its
    forward (ModelRunner: the graph's replay and compute_logits)."""
    if model not in _OPS:
        meta = MetaModel.build(hf_config(model), torch.bfloat16)
        a, b = 16, 32
        _OPS[model] = (AffineOps.fit(meta.trace_forward(a), meta.trace_forward(b), a, b),
                       AffineOps.fit(meta.trace_logits(b, a, sample=False),
                                     meta.trace_logits(b, b, sample=False), a, b))
    return _OPS[model]


def modelled_forward_s(point: DecodePoint, calibration: Calibration) -> float:
    buckets = capture_buckets(point.max_num_seqs, 2048, _MIXED_GRAPH_TOKENS, MAX_CAPTURE_SEQ_LEN)
    model = StepModel(forward_ops(point.model), Roofline(model_shape(point.model), H100),
                      calibration=calibration, graph_buckets=buckets)
    cost = model.step([1] * point.batch, [point.context] * point.batch, point.batch)
    assert cost.is_graph, "the offline run's decode steps replay graphs"
    return cost.device_s


def modelled_hf_padded_s(record: dict, launch_s: float, calibration: Calibration) -> float:
    """bench.offline_gpu's HF baseline: static batches of the record's workload."""
    result, args = record["results"][0], record["args"]
    workload = make_workload("mixed", args["num_prompts"],
                             (args["min_prompt_len"], args["max_prompt_len"]),
                             (args["min_output_len"], args["max_output_len"]),
                             MODEL_CONFIGS[result["model"]]["vocab_size"], args["seed"])
    hf = SimulatedHF(hf_config(result["model"]), torch.bfloat16, H100, calibration, launch_s)
    size = args["batch_size"]
    return sum(hf.generate_s([len(p) for p in workload.prompts[i:i + size]],
                             max(workload.output_lens[i:i + size]))
               for i in range(0, len(workload.prompts), size))


def solve(modelled: Callable[[float], float], target: float, x0: float, x1: float) -> float:
    """The x where modelled(x) = target, by secant steps (both models are affine in their
    constant while the modelled stream keeps its bound)."""
    y0, y1 = modelled(x0) - target, modelled(x1) - target
    for _ in range(8):
        if abs(y1) < 1e-9 * target or y1 == y0:
            break
        x0, x1 = x1, x1 - y1 * (x1 - x0) / (y1 - y0)
        y0, y1 = y1, modelled(x1) - target
    return x1


def fit_fused_fixed_s(point: DecodePoint) -> float:
    return solve(lambda x: modelled_forward_s(point, with_fused_fixed_s(H100_2026_11_26, x)),
                 point.measured_forward_s, 1.9e-6, 10e-6)


def fit_hf_launch_s(record: dict, calibration: Calibration) -> float:
    return solve(lambda x: modelled_hf_padded_s(record, x, calibration),
                 record["results"][0]["hf_padded_s"], HF_LAUNCH_S_2026_11_26, 80e-6)


def fit(results_dir: Path = RESULTS_DIR) -> dict:
    """The two constants from the fitting model's records (the held-out model's are not read)."""
    record = offline_record(FIT_MODEL, results_dir)
    fused_fixed_s = fit_fused_fixed_s(DecodePoint.of(record))
    calibration = with_fused_fixed_s(H100_2026_11_26, fused_fixed_s)
    return {"fused_fixed_s": fused_fixed_s,
            "hf_launch_s": fit_hf_launch_s(record, calibration)}


def row(record: str, quantity: str, measured: float, before: float | None, after: float | None,
        role: str, note: str = "") -> dict:
    def error(modelled: float | None) -> float | None:
        return None if modelled is None or not measured else modelled / measured - 1
    return {"record": record, "quantity": quantity, "measured": measured,
            "modelled_before": before, "modelled_after": after, "error_before": error(before),
            "error_after": error(after), "role": role, "note": note}


def kernel_rows(results_dir: Path) -> list[dict]:
    """bench.kernels_gpu's decode attention, priced as the step model prices a layer's
    paged_attention: split-KV two launches, unified one (the attention constants are the first
    run's fit to this kernel, and were not refit)."""
    name = f"kernels_gpu-{DEVICE_TAG}"
    record = load_record(name, results_dir)
    assert record["config"]["context_len"] > DECODE_PARTITION_SIZE
    cost = H100_CALIBRATION.op_classes["attention"]
    rows = []
    for result in record["results"]:
        num_launches = {"triton": 2, "triton-unified": 1}.get(result["backend"])
        if num_launches is None:
            continue
        modelled_us = 1e6 * (num_launches * cost.fixed_s + record["bytes_read"] / (
            H100.memory_bandwidth * cost.bandwidth_efficiency))
        rows.append(row(name, f"{result['backend']} paged decode attention, batch "
                        f"{record['config']['batch_size']} x {record['config']['context_len']} "
                        "context (us)", result["time_us"], modelled_us, modelled_us, "compared",
                        "not refit (the first run: triton 205 us, unified 191 us)"))
    return rows


def offline_rows(model: str, results_dir: Path) -> list[dict]:
    name = f"offline_gpu-{DEVICE_TAG}-{model}"
    record = offline_record(model, results_dir)
    measured = record["results"][0]
    point = DecodePoint.of(record)
    role = "fitted" if model == FIT_MODEL else "held out"
    forward = [modelled_forward_s(point, calibration) for calibration, _ in (BEFORE, AFTER)]
    rows = [
        row(name, f"median decode step's forward at batch {point.batch}, context "
            f"{point.context} (ms)", point.measured_forward_s * 1e3,
            *(f * 1e3 for f in forward), role, "graph replay + logits, no sampler"),
        row(name, "decode MBU, forward only", measured["decode"]["mbu_forward_only"],
            *(point.mbu(f) for f in forward), role, "same step"),
        row(name, "HF padded batches (s)", measured["hf_padded_s"],
            *(modelled_hf_padded_s(record, launch_s, calibration)
              for calibration, launch_s in (BEFORE, AFTER)), role,
            "host-bound: one launch per HF_LAUNCH_S"),
    ]
    runs = [_sim_record(f"offline_gpu-{tag}-{model}", results_dir) for tag in ("sim", "sim-calib")]
    for key, label, note in (
            ("pagedserve_forward_s", "whole run, steps' forward time (s)",
             "prefill and mixed steps included; the records hold no per-step times"),
            ("ratio_vs_hf_padded_forward_only", "x HF padded, forward time only", ""),
            ("pagedserve_tok_s", "output tok/s (wall)", "wall clock: this machine's host"),
            ("ratio_vs_hf_padded", "x HF padded (wall)", "wall clock: this machine's host")):
        rows.append(row(name, label, measured[key], *(r and r["results"][0][key] for r in runs),
                        "compared", note))
    for key, label, note in (
            ("median_forward_ms", "sim record: median decode step's forward (ms)",
             "the sim's forward includes greedy sampling"),
            ("median_batch_size", "median decode batch", "the schedule, not a price"),
            ("mbu_forward_only", "sim record: decode MBU, forward only", ""),
            ("median_step_ms", "median decode step, wall (ms)", "wall clock: this machine's host"),
            ("mbu", "decode MBU, wall", "wall clock: this machine's host")):
        rows.append(row(name, label, measured["decode"][key],
                        *(r and r["results"][0]["decode"][key] for r in runs), "compared", note))
    return rows


def serving_rows(results_dir: Path) -> list[dict]:
    """bench.serving's 1.7B-shape run against the simulator's: the gRPC stack's figures are wall
    clock, host-bound on this machine (not rerun after the refit); the in-process engine's
    tokens/s against bench.step_graphs' modelled device time alone (mixed-step graphs, as the
    H100 ran), an upper bound of a wall figure."""
    name = f"serving-{DEVICE_TAG}"
    measured = {r["workload"]: r for r in load_record(name, results_dir)["results"]}
    stack = _sim_record("serving-sim-smollm2-1.7b", results_dir)
    simulated = {r["workload"]: r for r in stack["results"]} if stack else {}
    graphs = [_sim_record(f"step_graphs-{tag}-smollm2-1.7b", results_dir)
              for tag in ("sim", "sim-calib")]
    rows = []
    for workload, result in measured.items():
        concurrency = result["concurrency"]
        sim = simulated.get(workload)
        for key, label in () if sim is None else (("output_tok_s", "gRPC stack tok/s"),
                                                  ("ttft_ms", "TTFT p50 (ms)"),
                                                  ("itl_ms", "ITL p50 (ms)")):
            value = result["stack"][key]
            modelled = sim["stack"][key]
            if isinstance(value, dict):
                value, modelled = value["p50"], modelled["p50"]
            rows.append(row(name, f"N={concurrency} {label}", value, modelled, None, "compared",
                            "wall clock: this machine's host (2 shared cores), not rerun"))
        modelled = [_graph_tok_s(g, concurrency) for g in graphs]
        if any(modelled):
            rows.append(row(name, f"N={concurrency} in-process engine tok/s",
                            result["in_process"]["output_tok_s"], *modelled, "compared",
                            "modelled: device time alone (bench.step_graphs, mixed graphs; "
                            "3 requests a client), an upper bound of the measured wall"))
    return rows


def _graph_tok_s(record: dict | None, concurrency: int) -> float | None:
    if record is None:
        return None
    return next((r["output_tok_per_modelled_s"] for r in record["results"]
                 if r["concurrency"] == concurrency and r["setting"] == "mixed"), None)


def _sim_record(name: str, results_dir: Path) -> dict | None:
    path = results_dir / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tag", default=RUN)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    fitted = fit()
    rows = (kernel_rows(RESULTS_DIR) + offline_rows(FIT_MODEL, RESULTS_DIR)
            + offline_rows(HELD_OUT_MODEL, RESULTS_DIR) + serving_rows(RESULTS_DIR))
    held_out = [r for r in rows if r["role"] == "held out" and "MBU" not in r["quantity"]]
    line = (f"calibration {RUN}: fused fixed {fitted['fused_fixed_s'] * 1e6:.2f} us, HF launch "
            f"{fitted['hf_launch_s'] * 1e6:.1f} us (fitted to {FIT_MODEL}); held out "
            f"{HELD_OUT_MODEL}: " + "; ".join(
                f"{r['quantity']} {r['modelled_after']:.4g} vs {r['measured']:.4g} measured "
                f"({r['error_after']:+.1%}, was {r['error_before']:+.1%})" for r in held_out))
    return finish("calibration", args, line, rows, is_model=True, fit=fitted,
                  constants={"fused_fixed_s": H100_CALIBRATION.op_classes["fused"].fixed_s,
                             "hf_launch_s": HF_LAUNCH_S})


if __name__ == "__main__":
    main()
