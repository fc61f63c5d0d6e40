"""The simulated GPU's step model: the kernels the real model code launches, priced with the H100
calibration. Against the H100 run's figures (the first three are the data the constants were
fitted to, so they show calibration, not validation; Qwen2.5-0.5B and Llama-3-8B at batch 36
were held out), and a change to the model code must change the simulated step by mechanism.
The H100 ran the layers' torch code on CUDA (code 9262bf6): the calibration tests trace that
code (`enable_fused_kernels=False`), the rest the fused kernels a GPU runs now."""

from __future__ import annotations

import pytest
import torch
from pagedserve.worker_svc.cuda_graphs import MAX_CAPTURE_SEQ_LEN
from pagedserve.worker_svc.graph_buckets import capture_buckets
from pagedserve.worker_svc.sim.calibration import ENGINE_HOST_S
from pagedserve.worker_svc.sim.roofline import GPUS, MODELS, ModelShape, Roofline
from pagedserve.worker_svc.sim.step_model import (
    DECODE_PARTITION_SIZE,
    SPLIT_KV_MAX_PROGRAMS,
    AffineOps,
    StepModel,
    traced_ops,
)
from pagedserve.worker_svc.sim.trace import MetaModel, hf_config_of, sim_hf_config

from tests.tiny_models import ARCHITECTURES

H100 = GPUS["H100-SXM"]
LIBRARY_CLASSES = ("gemm", "attention", "kv_write")  # cuBLAS and Triton, not aten launches
SMALL = ModelShape("small", 512, 4, 8, 2, 64, 1408, 4096)


def step_model(shape: ModelShape, max_num_seqs: int | None = None,
               enable_fused_kernels: bool = False, max_cuda_graph_tokens: int = 0) -> StepModel:
    """max_num_seqs None: eager steps only (enable_cuda_graph off); max_cuda_graph_tokens 0:
    decode-only graphs."""
    ops = traced_ops(hf_config_of(shape), torch.bfloat16, enable_fused_kernels)
    buckets = (capture_buckets(max_num_seqs, 2048, max_cuda_graph_tokens, MAX_CAPTURE_SEQ_LEN)
               if max_num_seqs else None)
    return StepModel(ops, Roofline(shape, H100), graph_buckets=buckets)


def decode(batch: int, context: int) -> tuple[list[int], list[int], int]:
    return [1] * batch, [context] * batch, batch


def num_aten_launches(model: StepModel) -> int:
    classes = model.forward.op_classes + model.logits.op_classes
    return sum(c not in LIBRARY_CLASSES for c in classes)


def test_llama_3_8b_eager_decode_step_matches_the_h100_profile():
    """Batch 32 after 512-token prompts (the median step of 160 is at ~592 tokens). The
    profile: 9.06 ms of GPU time and ~1,070 aten launches (cudaLaunchKernel) a step, ~1,306 with
    cuBLAS's and Triton's; 36 aten launches a layer. Its window held 293 layer passes for 10
    steps, so its per-step figures are a full 32-layer step's x ~0.92."""
    model = step_model(MODELS["Llama-3-8B"])
    cost = model.step(*decode(32, 592))
    assert not cost.is_graph
    assert cost.kernel_s == pytest.approx(9.06e-3, rel=0.15)
    assert num_aten_launches(model) == pytest.approx(1070, rel=0.15)
    assert cost.num_launches == pytest.approx(1306, rel=0.15)
    layer = model.forward.op_classes[1:-9]  # the embedding before, the final norm after
    assert sum(c not in LIBRARY_CLASSES for c in layer) == 36 * 32 - 1  # layer 0: no residual
    # host-bound: 30.51 ms median with graphs off
    assert cost.device_s + ENGINE_HOST_S == pytest.approx(30.51e-3, rel=0.15)
    assert cost.roofline_floor_s < cost.kernel_s < cost.device_s


def test_llama_3_8b_graph_step_matches_the_in_process_engine():
    """Same workload, graphs on: 11.56 ms median step (LLMEngine.step with a device sync)."""
    cost = step_model(MODELS["Llama-3-8B"], max_num_seqs=32).step(*decode(32, 592))
    assert cost.is_graph and cost.num_launches < 10
    assert cost.device_s + ENGINE_HOST_S == pytest.approx(11.56e-3, rel=0.15)


@pytest.mark.parametrize(("shape", "batch", "context", "measured_s"), [
    # offline_gpu, median decode step; context from the record's KV bytes per sequence
    (MODELS["Qwen2.5-0.5B"], 27, 355, 4.56e-3),
    (MODELS["Llama-3-8B"], 36, 394, 11.82e-3),
])
def test_held_out_offline_decode_steps(shape, batch, context, measured_s):
    cost = step_model(shape, max_num_seqs=64).step(*decode(batch, context))
    assert cost.is_graph
    assert cost.device_s + ENGINE_HOST_S == pytest.approx(measured_s, rel=0.15)


# One decoder layer on the GPU path: norm (its residual add fused), the QKV GEMM, rotary fused
# with the K/V cache write, attention, o_proj, norm, the gate-up GEMM, SiLU-and-mul, down_proj.
FUSED_LAYER = ("pagedserve::fused_add_rms_norm", "mm", "pagedserve::rotary_write_kv",
               "paged_attention", "mm", "pagedserve::fused_add_rms_norm", "mm",
               "pagedserve::silu_and_mul", "mm")


def test_llama_3_8b_decode_step_launches_at_most_ten_kernels_a_layer():
    """Issue #29's target, from the trace of the model classes: each fused kernel is one custom
    op, so one recorded kernel. At 592 tokens of context attention is two launches (split-KV
    partition + reduce), the layer's tenth."""
    shape = MODELS["Llama-3-8B"]
    fused = step_model(shape, enable_fused_kernels=True)
    names = fused.forward.names
    assert names[0] == "embedding" and names[-1] == "pagedserve::fused_add_rms_norm"
    layers = names[1:-1]
    assert layers == ("pagedserve::rms_norm", *FUSED_LAYER[1:]) + FUSED_LAYER * (
        shape.num_layers - 1)
    assert not {"_to_copy", "copy_"} & set(names)  # no dtype casts in the forward
    before, after = step_model(shape).step(*decode(32, 592)), fused.step(*decode(32, 592))
    num_tail = len(fused.logits.names)
    launches_per_layer = (after.num_kernels - num_tail - 2) / shape.num_layers
    assert launches_per_layer == 10
    assert (before.num_kernels - num_tail - 10) / shape.num_layers > 40
    # the profile's ~2.5 ms of small kernels, less the 97 fused kernels in their place
    # (8.9 us each since the 2026-11-27 fit: test_sim_calibration.py)
    assert after.kernel_s < before.kernel_s - 1.5e-3


@pytest.mark.parametrize("max_num_seqs", [None, 32])
def test_fused_kernels_show_up_as_fewer_kernels_and_less_time(max_num_seqs):
    """Nothing in the calibration changes: the trace of the layer code does."""
    before = step_model(SMALL, max_num_seqs).step(*decode(32, 600))
    fused = step_model(SMALL, max_num_seqs, enable_fused_kernels=True)
    after = fused.step(*decode(32, 600))
    assert len(fused.forward.names) == 2 + len(FUSED_LAYER) * SMALL.num_layers
    assert after.num_kernels < before.num_kernels / 3
    assert after.kernel_s < before.kernel_s
    assert after.device_s < before.device_s
    assert after.is_graph == before.is_graph == (max_num_seqs is not None)
    if max_num_seqs is None:  # launch-bound: each kernel fewer is a launch fewer
        assert before.host_s - after.host_s == pytest.approx(
            (before.num_launches - after.num_launches) * fused.calibration.eager_launch_s)


def test_rotary_write_kv_is_priced_by_the_rows_it_moves():
    """One table row per token, not the rotary table; the key and value it writes to the cache
    like the write_kv it replaces."""
    fused = step_model(SMALL, enable_fused_kernels=True)
    plain = step_model(SMALL)
    op = fused.forward.names.index("pagedserve::rotary_write_kv")
    kv_write = plain.forward.names.index("write_kv")
    query_bytes = SMALL.num_heads * SMALL.head_size * 2
    per_token = (8 + 8 + SMALL.head_size * 4  # position, slot, cos/sin row (float32)
                 + 2 * query_bytes)  # the query in and out
    assert fused.forward.bytes1[op] == per_token + plain.forward.bytes1[kv_write]
    assert fused.forward.bytes0[op] == 0


def test_a_captured_step_launches_once_and_prefill_runs_eagerly():
    model = step_model(SMALL, max_num_seqs=64)
    eager = step_model(SMALL)
    graph = model.step(*decode(20, 300))
    assert graph.is_graph and graph.host_s < eager.step(*decode(20, 300)).host_s / 10
    assert graph.device_s < eager.step(*decode(20, 300)).device_s
    # a decode batch pads to its bucket: 20 → 24 rows of everything but attention
    padded = model.step(*decode(24, 300))
    assert padded.kernel_s - graph.kernel_s < 0.02 * graph.kernel_s
    assert not model.step([40, 1], [0, 300], 2).is_graph  # a prefill chunk: mixed graphs off
    # a chunk that samples nothing launches no logits or sampling kernels
    assert (model.step([40], [0], 1).num_launches - model.step([40], [0], 0).num_launches
            == len(model.logits.names))
    assert not model.step(*decode(65, 300)).is_graph  # past the largest bucket


def test_a_mixed_step_that_fits_a_token_bucket_replays_a_graph():
    """The runner's rule and padding: 120 tokens (a 100-token prompt beside 20 decodes) run in
    the 128-token graph, the 8 padding tokens one more prompt; the unified kernel alone serves
    the graph's decodes."""
    model = step_model(SMALL, max_num_seqs=64, max_cuda_graph_tokens=512)
    eager = step_model(SMALL, max_num_seqs=64)
    step = [100] + [1] * 20, [0] + [300] * 20, 21
    graph = model.step(*step)
    assert graph.is_graph and not eager.step(*step).is_graph
    assert graph.host_s < eager.step(*step).host_s / 10
    assert graph.device_s < eager.step(*step).device_s
    padded = eager.step([100] + [1] * 20 + [8], [0] + [300] * 20 + [0], 21)
    assert graph.kernel_s == pytest.approx(padded.kernel_s)
    long_decodes = [108] + [1] * 20, [0] + [DECODE_PARTITION_SIZE + 100] * 20, 21  # 128 tokens
    assert (eager.step(*long_decodes).num_kernels - model.step(*long_decodes).num_kernels
            == 2 * SMALL.num_layers)
    assert not model.step([600, 1], [0, 300], 2).is_graph  # past the largest bucket
    assert model.step(*decode(20, 300)).num_kernels == eager.step(*decode(20, 300)).num_kernels


def test_attention_is_priced_by_the_kv_it_reads():
    model = step_model(SMALL)
    short, long = model.step(*decode(32, 1000)), model.step(*decode(32, 2000))
    kv_bytes = SMALL.num_layers * 32 * 1000 * 2 * SMALL.num_kv_heads * SMALL.head_size * 2
    attention = model.calibration.op_classes["attention"]
    assert long.kernel_s - short.kernel_s == pytest.approx(
        kv_bytes / (H100.memory_bandwidth * attention.bandwidth_efficiency))
    # one launch while every context fits a partition, two (split-KV) past it
    assert (model.step(*decode(8, DECODE_PARTITION_SIZE + 1)).num_launches
            - model.step(*decode(8, DECODE_PARTITION_SIZE - 1)).num_launches) == SMALL.num_layers
    # ... unless the batch fills the device with one program per (sequence, KV head)
    many = -(-SPLIT_KV_MAX_PROGRAMS // SMALL.num_kv_heads)
    assert (model.step(*decode(many, DECODE_PARTITION_SIZE + 1)).num_launches
            == model.step(*decode(many, DECODE_PARTITION_SIZE - 1)).num_launches)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_served_architecture_is_traced_from_its_config(tiny_model_dir, arch):
    forward, logits = traced_ops(sim_hf_config(str(tiny_model_dir(arch))), torch.bfloat16)
    num_layers = 2
    assert forward.op_classes.count("attention") == forward.op_classes.count("kv_write") \
        == num_layers
    assert forward.op_classes.count("gemm") >= 4 * num_layers
    assert logits.op_classes.count("gemm") == 1  # the lm_head


def test_the_partition_size_is_the_triton_backends():
    triton_ops = pytest.importorskip("pagedserve.kernels.triton_ops")
    assert triton_ops.DECODE_PARTITION_SIZE == DECODE_PARTITION_SIZE
    assert triton_ops.SPLIT_KV_MAX_PROGRAMS == SPLIT_KV_MAX_PROGRAMS


def test_op_shapes_are_affine_in_the_token_count():
    """What lets two traces stand for every step size."""
    meta_model = MetaModel.build(hf_config_of(SMALL), torch.bfloat16)
    fitted = AffineOps.fit(meta_model.trace_forward(16), meta_model.trace_forward(32), 16, 32)
    traced = meta_model.trace_forward(24)
    num_bytes, flops = fitted.at(24)
    assert [op.name for op in traced] == list(fitted.names)
    assert num_bytes.tolist() == [op.bytes for op in traced]
    assert flops.tolist() == [op.flops for op in traced]
    with pytest.raises(ValueError, match="different ops"):
        AffineOps.fit(meta_model.trace_forward(16), meta_model.trace_logits(16, 16), 16, 32)


def test_qwen3_q_k_norms_ride_in_the_rotary_kernel(tiny_model_dir):
    """Qwen3's per-head RMSNorms of query and key add no launch: its layers trace as Llama's
    (the rotary + K/V write kernel normalizes each head first)."""
    qwen3, _ = traced_ops(sim_hf_config(str(tiny_model_dir("qwen3"))), torch.bfloat16)
    llama, _ = traced_ops(sim_hf_config(str(tiny_model_dir("llama"))), torch.bfloat16)
    assert qwen3.names == llama.names
