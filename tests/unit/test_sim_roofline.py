"""The simulated GPU's roofline and memory sizing against hand computations and published
numbers."""

import json

import pytest
import torch
from pagedserve.services.common.config import CacheConfig, GiB, SchedulerConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.worker_svc.cache_engine import KVCacheSpec
from pagedserve.worker_svc.sim.memory import CUDA_CONTEXT_BYTES, sim_memory_profile
from pagedserve.worker_svc.sim.roofline import GPUS, MODELS, Roofline, resolve_model_shape

LLAMA = MODELS["Llama-3-8B"]
H100 = GPUS["H100-SXM"]


@pytest.mark.parametrize(("name", "published"), [
    ("Llama-3-8B", 8.03e9), ("Qwen2.5-7B", 7.62e9), ("Llama-3.2-1B", 1.24e9)])
def test_parameter_counts_match_the_published_ones(name, published):
    assert MODELS[name].num_params == pytest.approx(published, rel=0.005)


def test_llama3_8b_decode_floor_on_h100_is_the_published_4_8_ms():
    cost = Roofline(LLAMA, H100, overhead_s=100e-6).step([1], [0], 1)
    # by hand: 32 layers x (4096 x (2x4096 + 2x1024) + 3 x 4096 x 14336 + 2 x 4096 norms)
    # + lm_head 128256 x 4096 + final norm, bf16; plus one embedding row, one token's KV read
    # and written (2 x 32 layers x 8 heads x 128 x 2 bytes each)
    weights = (32 * (4096 * 10240 + 3 * 4096 * 14336 + 2 * 4096) + 128256 * 4096 + 4096) * 2
    assert cost.bytes == weights + 4096 * 2 + 2 * 131072 == 15_010_119_680
    assert cost.memory_s == pytest.approx(15_010_119_680 / 3.35e12)
    assert cost.compute_s < cost.memory_s / 100  # batch 1 is bandwidth-bound
    assert cost.time_s == pytest.approx(16e9 / 3.35e12, rel=0.05)  # "16 GB / 3.35 TB/s"


def test_a_long_prefill_is_compute_bound():
    cost = Roofline(LLAMA, H100).step([2048], [0], 1)
    layers = 2 * 32 * (4096 * 10240 + 3 * 4096 * 14336) * 2048
    attention = 4 * 32 * 32 * 128 * (2048 * 2049 // 2)
    assert cost.flops == layers + attention + 2 * 128256 * 4096
    assert cost.time_s == cost.compute_s == pytest.approx(cost.flops / 989.4e12)
    assert cost.compute_s > 5 * cost.memory_s


def test_decode_kv_reads_grow_with_context_and_calibration_scales_peaks():
    roofline = Roofline(LLAMA, H100)
    short, long = roofline.step([1] * 64, [100] * 64, 64), roofline.step([1] * 64, [1100] * 64, 64)
    assert long.bytes - short.bytes == 64 * 1000 * 131072
    half = Roofline(LLAMA, H100, bandwidth_efficiency=0.5, flops_efficiency=0.5)
    assert half.step([1] * 64, [100] * 64, 64).memory_s == pytest.approx(2 * short.memory_s)
    assert Roofline(LLAMA, GPUS["H200"]).step([1], [0], 1).memory_s == pytest.approx(
        15_010_119_680 / 4.8e12)


def test_shapes_from_a_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
        "tie_word_embeddings": True, "max_position_embeddings": 256}))
    shape = resolve_model_shape(str(tmp_path))
    assert (shape.head_size, shape.num_kv_heads, shape.tie_word_embeddings) == (16, 2, True)
    assert shape.num_params == 2 * (64 * (2 * 64 + 2 * 32) + 3 * 64 * 128 + 2 * 64) + 512 * 64 + 64
    with pytest.raises(ConfigError, match="sim_model must be one of"):
        resolve_model_shape(str(tmp_path / "missing"))


def test_kv_blocks_are_sized_like_the_gpu_would_hold_them():
    spec = KVCacheSpec(32, 8, 128, 16, torch.bfloat16)
    assert spec.bytes_per_block == 2 * 1024 * 1024
    roofline = Roofline(LLAMA, H100)
    profile = sim_memory_profile(roofline, spec, CacheConfig(), SchedulerConfig())
    activations = 2048 * (2 * 14336 + 4 * 4096) * 2 + 256 * 128256 * 4
    budget = 81559 * 2**20 * 0.9 - CUDA_CONTEXT_BYTES - LLAMA.num_params * 2 - activations
    assert profile.num_gpu_blocks == int(budget // spec.bytes_per_block)
    assert 400_000 < profile.num_gpu_blocks * 16 < 500_000  # tokens of KV an H100 holds
    assert profile.num_cpu_blocks == 4 * GiB // spec.bytes_per_block
    with pytest.raises(ConfigError, match="does not fit"):
        sim_memory_profile(Roofline(LLAMA, GPUS["L4"]), spec,
                           CacheConfig(gpu_memory_utilization=0.6), SchedulerConfig())
