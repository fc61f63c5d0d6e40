"""bench/hf_sim.py: HF generate's padded batches priced by the simulator's calibrated model
against the H100 records it was not fitted to (each run's launch cost was fitted to its
Llama-3-8B record)."""

from __future__ import annotations

import pytest
import torch
import transformers
from pagedserve.worker_svc.sim.calibration import H100_2026_11_26, H100_CALIBRATION, Calibration
from pagedserve.worker_svc.sim.roofline import resolve_gpu

from bench.calibration import modelled_hf_padded_s, offline_record
from bench.common import make_workload
from bench.hf_sim import HF_LAUNCH_S, HF_LAUNCH_S_2026_11_26, SimulatedHF
from bench.offline_gpu import MODEL_CONFIGS


def _simulated(name: str, calibration: Calibration = H100_CALIBRATION,
               launch_s: float = HF_LAUNCH_S) -> tuple[SimulatedHF, dict]:
    config = MODEL_CONFIGS[name]
    hf_config = transformers.AutoConfig.for_model(
        **{k: v for k, v in config.items() if k != "architectures"})
    return SimulatedHF(hf_config, torch.bfloat16, resolve_gpu("H100-SXM"), calibration,
                       launch_s), config


def test_qwen_padded_batch_matches_the_first_runs_held_out_record():
    """The first run's fit (HF_LAUNCH_S_2026_11_26, fitted to its Llama-3-8B record) against
    its offline_gpu-qwen2.5-0.5b.json: one static batch of the 64 mixed-workload prompts, HF
    padded 16.28 s on the H100 of 2026-11-26."""
    hf, config = _simulated("qwen2.5-0.5b", H100_2026_11_26, HF_LAUNCH_S_2026_11_26)
    wl = make_workload("mixed", 64, (32, 512), (32, 256), config["vocab_size"], 0)
    modelled_s = hf.generate_s([len(p) for p in wl.prompts], max(wl.output_lens))
    assert modelled_s == pytest.approx(16.28, rel=0.15)


def test_qwen_padded_batches_match_the_committed_held_out_record():
    """The refit (HF_LAUNCH_S, fitted to the 2026-11-27 Llama-3-8B record; HF ran 18% slower
    that day than the day before, on the same code) against that run's Qwen2.5-0.5B record,
    read from bench/results."""
    record = offline_record("qwen2.5-0.5b")
    modelled_s = modelled_hf_padded_s(record, HF_LAUNCH_S, H100_CALIBRATION)
    assert modelled_s == pytest.approx(record["results"][0]["hf_padded_s"], rel=0.15)


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
