"""bench/hf_sim.py: HF generate's padded batches priced by the simulator's calibrated model
against the H100 record it was not fitted to."""

from __future__ import annotations

import pytest
import torch
import transformers
from pagedserve.worker_svc.sim.roofline import resolve_gpu

from bench.common import make_workload
from bench.hf_sim import SimulatedHF
from bench.offline_gpu import MODEL_CONFIGS


def _simulated(name: str) -> tuple[SimulatedHF, dict]:
    config = MODEL_CONFIGS[name]
    hf_config = transformers.AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"})
    return SimulatedHF(hf_config, torch.bfloat16, resolve_gpu("H100-SXM")), config


def test_qwen_padded_batch_matches_the_held_out_h100_record():
    """offline_gpu-qwen2.5-0.5b.json: one static batch of the 64 mixed-workload prompts, HF
    padded 16.28 s on the H100 (the launch cost was fitted to Llama-3-8B's record)."""
    hf, config = _simulated("qwen2.5-0.5b")
    wl = make_workload("mixed", 64, (32, 512), (32, 256), config["vocab_size"], 0)
    modelled_s = hf.generate_s([len(p) for p in wl.prompts], max(wl.output_lens))
    assert modelled_s == pytest.approx(16.28, rel=0.15)


def test_a_decode_step_copies_the_cache_and_attends_once_a_layer():
    """DynamicCache appends by torch.cat, so a step's bytes grow with the context; sdpa is one
    attention kernel per layer, not the math path meta would decompose it into."""
    hf, config = _simulated("tiny-llama")
    ops = hf._decode_ops(batch=4)
    layers = config["num_hidden_layers"]
    assert ops.op_classes.count("attention") == layers
    short, long = ops.at(100)[0], ops.at(1000)[0]
    growing = [name for i, name in enumerate(ops.names) if long[i] > short[i]]
    assert growing.count("cat") == 2 * layers  # K and V of every layer
