"""Offline throughput on a GPU with random weights of real shapes, against HF generate on the
same GPU, same run; and the decode steps' model bandwidth utilization (MBU).

No downloads: the script writes each model's config.json into a temporary folder and the engine
fills the weights with `load_format=dummy`; HF builds the same architecture from the same config
with its own random init. Per model:
  - pagedserve LLMEngine on the seeded mixed workload (bench/offline.py's shape): output tokens/s;
  - HF generate, static left-padded batches of --batch-size (and, with --hf-sequential, one
    request at a time): tokens/s and the ratios;
  - decode MBU = (weight bytes + KV bytes read) per decode-only step ÷ step time ÷ peak HBM
    bandwidth, as the median over those steps (also with the forward time alone), and the
    steps' median host CPU time (all threads of this process);
  - the workload's time with each step taking its forward time alone (`pagedserve_forward_s`):
    the engine's time if its host work kept up with the device.
The record goes to bench/results/offline_gpu-<tag>.json.

`--device sim` runs the engine on the simulated GPU (`--sim-gpu`; the model's config.json is the
simulated model, its step time the calibrated kernel model of docs/simulated-gpu.md) and models
HF's padded batches with the same kernel prices (bench/hf_sim.py): every figure is a model. The
host work is real, on this machine's CPU.

    python -m bench.offline_gpu                                  # Qwen2.5-0.5B and Llama-3-8B
    python -m bench.offline_gpu --device cpu --models tiny-llama --num-prompts 4 --tag smoke
    python -m bench.offline_gpu --device sim --models llama-3-8b --tag sim-llama-3-8b
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import logging
import os
import statistics
import tempfile
from pathlib import Path

import torch
import transformers
from pagedserve.services.common.gc_tuning import raised_thresholds
from pagedserve.worker_svc.sim.roofline import resolve_gpu

from bench.common import (
    Timer,
    Workload,
    finish,
    hf_generate,
    make_workload,
    quiet_logging,
    sync_device,
)
from bench.hf_sim import SimulatedHF
from bench.kernels_gpu import peak_gbps
from bench.step_anatomy import StepRecorder, decode_step_seq_ids
from pagedserve.llm_engine import LLMEngine

log = logging.getLogger("bench.offline_gpu")

# The public config.json of each model, minus fields that do not change the shapes.
MODEL_CONFIGS: dict[str, dict] = {
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 896, "intermediate_size": 4864, "num_attention_heads": 14,
        "num_hidden_layers": 24, "num_key_value_heads": 2, "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
        "vocab_size": 151936, "bos_token_id": 151643, "eos_token_id": 151645,
        "use_sliding_window": False},
    "llama-3-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
        "num_hidden_layers": 32, "num_key_value_heads": 8, "max_position_embeddings": 8192,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
        "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": 128001,
        "attention_bias": False, "mlp_bias": False},
    # bench.serving's 1.7B model (SmolLM2-1.7B; its tokenizer is SmolLM2-135M's)
    "smollm2-1.7b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32,
        "num_hidden_layers": 24, "num_key_value_heads": 32, "head_dim": 64,
        "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 130000.0,
        "tie_word_embeddings": True, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
        "pad_token_id": 2, "attention_bias": False, "mlp_bias": False},
    # a smoke-test shape: runs anywhere in seconds
    "tiny-llama": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "vocab_size": 4096, "bos_token_id": 1, "eos_token_id": 2},
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def write_model_dir(name: str, dtype: str, root: Path) -> Path:
    model_dir = root / name
    model_dir.mkdir(parents=True, exist_ok=True)
    config = {**MODEL_CONFIGS[name], "torch_dtype": dtype}
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return model_dir


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes of parameters one decode step reads: all of them, except an untied input
    embedding (only the batch's rows of it are read)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_submodule("model.embed_tokens").weight
    lm_head = getattr(model, "lm_head", None)
    if lm_head is None or lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def run_pagedserve(engine: LLMEngine, wl: Workload) -> tuple[float, float, list[dict]]:
    """Wall time of the whole workload, the forward time of all its steps, and per decode-only
    step: its time, forward time, the host's CPU time (every thread) and KV bytes read."""
    recorder = StepRecorder(engine.core)
    worker = engine.core.workers[0]
    spec = worker.kv_spec
    kv_bytes_per_token = (2 * spec.num_layers * spec.num_kv_heads * spec.head_size
                          * spec.dtype.itemsize)
    for i, (prompt, sampling) in enumerate(zip(wl.prompts, wl.sampling_params(), strict=True)):
        engine.add_request(f"{wl.name}-{i}", prompt, sampling)
    steps = []
    forward_s = 0.0
    with Timer() as t, raised_thresholds():  # as LLM.generate steps
        while engine.has_unfinished_requests():
            record = recorder.step()
            plan = record.get("plan")
            if plan is None:
                continue
            forward_s += record["timings"].forward_ns / 1e9
            seq_ids = decode_step_seq_ids(plan)
            if not seq_ids:
                continue
            mirror = worker.runner.mirrors.seqs
            num_kv_tokens = sum(mirror[seq_id].num_computed_tokens for seq_id in seq_ids
                                if seq_id in mirror)
            steps.append({"batch_size": len(seq_ids), "step_s": record["step_ns"] / 1e9,
                          "forward_s": record["timings"].forward_ns / 1e9,
                          "cpu_s": record["step_cpu_ns"] / 1e9,
                          "kv_bytes": num_kv_tokens * kv_bytes_per_token})
    return t.elapsed_s, forward_s, steps


def decode_mbu(steps: list[dict], weight_bytes: int, peak: float | None) -> dict:
    if not steps:
        return {}
    step_gbps = [(weight_bytes + s["kv_bytes"]) / s["step_s"] / 1e9 for s in steps]
    fwd_gbps = [(weight_bytes + s["kv_bytes"]) / s["forward_s"] / 1e9 for s in steps]
    out = {"num_decode_steps": len(steps),
           "median_step_ms": statistics.median(s["step_s"] for s in steps) * 1e3,
           "median_forward_ms": statistics.median(s["forward_s"] for s in steps) * 1e3,
           "median_host_cpu_ms": statistics.median(s["cpu_s"] for s in steps) * 1e3,
           "median_batch_size": statistics.median(s["batch_size"] for s in steps),
           "median_gbps": statistics.median(step_gbps),
           "median_forward_gbps": statistics.median(fwd_gbps), "peak_gbps": peak}
    if peak:
        out["mbu"] = out["median_gbps"] / peak
        out["mbu_forward_only"] = out["median_forward_gbps"] / peak
    return out


def bench_model(name: str, args: argparse.Namespace, root: Path) -> dict:
    dtype = DTYPES[args.dtype]
    model_dir = write_model_dir(name, args.dtype, root)
    vocab = MODEL_CONFIGS[name]["vocab_size"]
    wl = make_workload("mixed", args.num_prompts, (args.min_prompt_len, args.max_prompt_len),
                       (args.min_output_len, args.max_output_len), vocab, args.seed)
    warm = make_workload("warmup", 4, (16, 64), (8, 8), vocab, seed=args.seed + 1)
    result = {"model": name, **wl.describe(), "batch_size": args.batch_size}
    config = transformers.AutoConfig.from_pretrained(model_dir)
    if args.device == "sim":
        hf_sim = SimulatedHF(config, dtype, resolve_gpu(args.sim_gpu))
        result.update(hf_padded(wl, args, lambda prompts, n: hf_sim.generate_s(
            [len(p) for p in prompts], n), hf_is_model=True))
        weight_bytes = weight_bytes_read(hf_sim.model)
        engine_kwargs = {"sim_model": str(model_dir), "sim_gpu": args.sim_gpu}
        peak = resolve_gpu(args.sim_gpu).memory_bandwidth / 1e9
    else:
        result.update(hf_measured(wl, warm, config, dtype, args))
        weight_bytes = None
        engine_kwargs = {"kv_cache_memory_gib": 1.0} if args.device == "cpu" else {}
        peak = peak_gbps(torch.device(args.device))
    log.info("%s: HF padded %.1f s", name, result["hf_padded_s"])

    engine = LLMEngine.from_kwargs(model=str(model_dir), load_format="dummy", dtype=args.dtype,
                                   device=args.device, max_num_seqs=args.batch_size,
                                   seed=args.seed, **engine_kwargs)
    run_pagedserve(engine, warm)
    ours_s, forward_s, steps = run_pagedserve(engine, wl)
    log.info("%s: pagedserve %.1f s", name, ours_s)
    if weight_bytes is None:
        weight_bytes = weight_bytes_read(engine.core.workers[0].runner.model)
    result.update(pagedserve_s=ours_s, pagedserve_tok_s=wl.num_output_tokens / ours_s,
                  ratio_vs_hf_padded=result["hf_padded_s"] / ours_s,
                  pagedserve_forward_s=forward_s,
                  ratio_vs_hf_padded_forward_only=result["hf_padded_s"] / forward_s,
                  weight_bytes=weight_bytes, decode=decode_mbu(steps, weight_bytes, peak))
    if "hf_sequential_s" in result:
        result["ratio_vs_hf_sequential"] = result["hf_sequential_s"] / ours_s
    engine.close()
    del engine
    _free(args.device)
    return result


def hf_padded(wl: Workload, args: argparse.Namespace, generate, hf_is_model: bool = False
              ) -> dict:
    """Static batches of --batch-size, each generating its longest request's tokens;
    `generate(prompts, num_new_tokens)` returns its seconds."""
    total_s = sum(generate(wl.prompts[start:start + args.batch_size],
                           max(wl.output_lens[start:start + args.batch_size]))
                  for start in range(0, len(wl.prompts), args.batch_size))
    return {"hf_padded_s": total_s, "hf_padded_tok_s": wl.num_output_tokens / total_s,
            "hf_is_model": hf_is_model}


def hf_measured(wl: Workload, warm: Workload, config: transformers.PretrainedConfig,
                dtype: torch.dtype, args: argparse.Namespace) -> dict:
    """HF generate on the device, then freed, so that the engine may take its share of the
    device memory."""
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    hf_generate(hf, warm.prompts, 8)

    result = hf_padded(wl, args, functools.partial(_timed_generate, hf))
    if args.hf_sequential:
        sequential_s = sum(_timed_generate(hf, [prompt], n) for prompt, n in
                           zip(wl.prompts, wl.output_lens, strict=True))
        result.update(hf_sequential_s=sequential_s,
                      hf_sequential_tok_s=wl.num_output_tokens / sequential_s)
    del hf
    _free(args.device)
    return result


def _timed_generate(hf: torch.nn.Module, prompts: list[list[int]], num_new_tokens: int) -> float:
    with Timer() as t:
        hf_generate(hf, prompts, num_new_tokens)
        sync_device(hf.device)
    return t.elapsed_s


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()




def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["qwen2.5-0.5b", "llama-3-8b"],
                        choices=sorted(MODEL_CONFIGS))
    parser.add_argument("--device", default="cuda",
                        help="cuda; sim: the calibrated simulated GPU (a model); cpu: a smoke run")
    parser.add_argument("--sim-gpu", default="H100-SXM", help="device sim: the modelled GPU")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64,
                        help="pagedserve's max_num_seqs and the HF static batch size")
    parser.add_argument("--min-prompt-len", type=int, default=32)
    parser.add_argument("--max-prompt-len", type=int, default=512)
    parser.add_argument("--min-output-len", type=int, default=32)
    parser.add_argument("--max-output-len", type=int, default=256)
    parser.add_argument("--hf-sequential", action="store_true",
                        help="also time HF one request at a time (slow)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="gpu")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but CUDA is not available (use --device cpu for a smoke run)")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    with tempfile.TemporaryDirectory(prefix="pagedserve-bench-") as tmp:
        results = [bench_model(name, args, Path(tmp)) for name in args.models]

    def describe(r: dict) -> str:
        d = r["decode"]
        mbu = "n/a" if d.get("mbu") is None else f"{d['mbu']:.0%} ({d['mbu_forward_only']:.0%})"
        return (f"{r['model']} {r['pagedserve_tok_s']:.0f} tok/s = {r['ratio_vs_hf_padded']:.2f}x "
                f"HF padded ({r['ratio_vs_hf_padded_forward_only']:.2f}x), decode MBU {mbu}, "
                f"median decode step {d.get('median_step_ms', 0):.2f} ms "
                f"({d.get('median_forward_ms', 0):.2f}) at batch {d.get('median_batch_size')}")
    forward_only = " (in brackets: the steps' forward time alone, as if the host kept up)"
    line = ("offline gpu" + (f" (modelled: simulated {args.sim_gpu}, HF modelled too; "
                             f"load average {os.getloadavg()[0]:.1f})"
                             if args.device == "sim" else "") + forward_only + ": "
            + "; ".join(map(describe, results)))
    return finish("offline_gpu", args, line, results, dtype=args.dtype,
                  is_model=args.device == "sim")


if __name__ == "__main__":
    main()
