"""The simulated GPU's step model: the kernels the real model code launches, priced with the H100
calibration. Against the H100 run's figures (the first three are the data the constants were
fitted to, so they show calibration, not validation; Qwen2.5-0.5B and Llama-3-8B at batch 36
were held out), and a change to the model code must change the simulated step by mechanism."""

from __future__ import annotations

import pytest
import torch
from pagedserve.worker_svc.cuda_graphs import capture_batch_sizes
from pagedserve.worker_svc.layers.norm import RMSNorm
from pagedserve.worker_svc.models.llama import LlamaForCausalLM
from pagedserve.worker_svc.sim.calibration import ENGINE_HOST_S
from pagedserve.worker_svc.sim.roofline import GPUS, MODELS, ModelShape, Roofline
from pagedserve.worker_svc.sim.step_model import (
    DECODE_PARTITION_SIZE,
    AffineOps,
    StepModel,
    trace_ops,
    traced_ops,
)
from pagedserve.worker_svc.sim.trace import MetaModel, hf_config_of, sim_hf_config

from tests.tiny_models import ARCHITECTURES

H100 = GPUS["H100-SXM"]
LIBRARY_CLASSES = ("gemm", "attention", "kv_write")  # cuBLAS and Triton, not aten launches
SMALL = ModelShape("small", 512, 4, 8, 2, 64, 1408, 4096)


def step_model(shape: ModelShape, max_num_seqs: int | None = None) -> StepModel:
    """max_num_seqs None: eager steps only (enable_cuda_graph off)."""
    ops = traced_ops(hf_config_of(shape), torch.bfloat16)
    sizes = capture_batch_sizes(max_num_seqs) if max_num_seqs else []
    return StepModel(ops, Roofline(shape, H100), graph_batch_sizes=sizes)


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


@torch.library.custom_op("pagedserve_test::fused_add_rms_norm", mutates_args=())
def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    x32 = summed.float()
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out, summed


@fused_add_rms_norm.register_fake
def _(x, residual, weight, eps):  # noqa: ANN001, ANN202
    return torch.empty_like(x), torch.empty_like(x)


class FusedAddRMSNorm(RMSNorm):
    """A norm whose residual add, statistics and scaling are one kernel."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return fused_add_rms_norm(x, torch.zeros_like(x), self.weight, self.eps)[0]
        return fused_add_rms_norm(x, residual, self.weight, self.eps)


class FusedNormLlama(LlamaForCausalLM):
    def __init__(self, config, backend, max_position, **kwargs) -> None:  # noqa: ANN001
        super().__init__(config, backend, max_position, **kwargs)
        for layer in self.model.layers:
            for name in ("input_layernorm", "post_attention_layernorm"):
                setattr(layer, name, FusedAddRMSNorm(config.hidden_size, config.rms_norm_eps))
        self.model.norm = FusedAddRMSNorm(config.hidden_size, config.rms_norm_eps)


@pytest.mark.parametrize("max_num_seqs", [None, 32])
def test_a_fused_norm_shows_up_as_fewer_kernels_and_less_time(max_num_seqs):
    """Nothing in the calibration changes: the trace of the changed model code does."""
    config = hf_config_of(SMALL)
    sizes = capture_batch_sizes(max_num_seqs) if max_num_seqs else []
    floor = Roofline(SMALL, H100)
    plain = StepModel(traced_ops(config, torch.bfloat16), floor, graph_batch_sizes=sizes)
    fused = StepModel(trace_ops(MetaModel.build(config, torch.bfloat16, FusedNormLlama)), floor,
                      graph_batch_sizes=sizes)
    before, after = plain.step(*decode(32, 600)), fused.step(*decode(32, 600))
    # a norm after a residual was 9 kernels (add, 2 casts, pow, mean, add, rsqrt, 2 muls), now
    # 1; the first layer's (no residual) was 8, now 2 (a zeros fill for the residual)
    assert before.num_kernels - after.num_kernels == 8 * 2 * SMALL.num_layers + 6
    assert after.kernel_s < before.kernel_s
    assert after.device_s < before.device_s
    assert after.is_graph == before.is_graph == (max_num_seqs is not None)
    if max_num_seqs is None:  # launch-bound: each kernel fewer is a launch fewer
        assert before.host_s - after.host_s == pytest.approx(
            (before.num_launches - after.num_launches) * plain.calibration.eager_launch_s)


def test_a_captured_step_launches_once_and_prefill_runs_eagerly():
    model = step_model(SMALL, max_num_seqs=64)
    eager = step_model(SMALL)
    graph = model.step(*decode(20, 300))
    assert graph.is_graph and graph.host_s < eager.step(*decode(20, 300)).host_s / 10
    assert graph.device_s < eager.step(*decode(20, 300)).device_s
    # a decode batch pads to its bucket: 20 → 24 rows of everything but attention
    padded = model.step(*decode(24, 300))
    assert padded.kernel_s - graph.kernel_s < 0.02 * graph.kernel_s
    assert not model.step([40, 1], [0, 300], 2).is_graph  # a prefill chunk in the step
    # a chunk that samples nothing launches no logits or sampling kernels
    assert (model.step([40], [0], 1).num_launches - model.step([40], [0], 0).num_launches
            == len(model.logits.names))
    assert not model.step(*decode(65, 300)).is_graph  # past the largest bucket


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
