"""What a kernel of each op class costs on the simulated GPU, fitted to the H100 runs (one H100
80GB HBM3, torch 2.11 / CUDA 13, Triton 3.6, Llama-3-8B and Qwen2.5-0.5B with dummy bf16
weights). A kernel takes
    fixed_s + max(bytes / (bandwidth x bandwidth_efficiency), flops / (peak x flops_efficiency)).

The first run (code 9262bf6, 2026-11-26, the layers' torch code, decode-only graphs) gave every
constant below; the second (code 47d62ba, 2026-11-27, fused layer kernels, mixed graphs) refit
the one that no kernel of the first had measured, the fused kernels' fixed cost
(`python -m bench.calibration`, record bench/results/calibration-2026-11-27-h100.json):

| constant | value | fitted to |
|---|---|---|
| fused fixed | 8.9 us (was 1.9 us, assumed) | offline_gpu-nvidia-h100-80gb-hbm3-47d62ba-llama-3-8b.json: median decode forward 7.65 ms at batch 30 (graphs, through the float32 logits); held out: Qwen2.5-0.5B's, 1.56 ms at batch 26, modelled within 2%. The two records' shortfalls under the first fit (0.63 and 0.48 ms) are in proportion to their kernels a step (296, 224); a per-node graph cost fits them as well (2.7 us a node: Qwen2.5-0.5B within 2% too), but puts the first run's graph step (1,390 nodes, 11.56 ms) 28% over, which has no fused kernel. An effective cost, not a profile: it holds whatever the fused kernels' steps cost beyond the model (their small grids, the graph's input-buffer copies before a replay) |

The first run's fit, kept as `H100_2026_11_26`:

| constant | value | fitted to |
|---|---|---|
| gemm fixed, bandwidth eff. | 2.7 us, 0.83 | least squares over the five cuBLAS decode GEMMs of the eager profile (Llama-3-8B, batch 32): qkv 22.4 us, o 14.6, gate_up 85.7, down 46.0 (its split-K reduce included), lm_head 383 us; each within 7% |
| gemm flops eff. | 0.75 | assumed: no compute-bound GEMM was profiled |
| attention fixed, bandwidth eff. | 2.0 us per launch, 0.80 | bench.kernels_gpu, triton split-KV decode, batch 32 x 4096 context, 32/8 heads x 128: 205 us for 537 MB; the eager profile's 35.4 us per layer (partition + reduce) then implies a 640-token context, inside the run's 512-672 |
| attention flops eff. | 0.5 | assumed: no prefill attention was profiled |
| kv_write fixed | 1.9 us | eager profile: write_kv_kernel, 1.90 us mean (also prices rotary_write_kv, the same kernel with the key rotated) |
| fused fixed | 1.9 us | assumed: the fused layer kernels (kernels.layer_ops: RMSNorm, SiLU-and-mul) are Triton row kernels like write_kv_kernel, the one such kernel profiled; none of them ran in the profile (refit above) |
| elementwise fixed | 1.3 us | eager profile: PyTorch's vectorized and unrolled elementwise kernels, 17 a layer, 26.9 us a layer |
| strided fixed | 2.4 us | eager profile: the generic (offset-computing) elementwise kernels, 14 a layer, 37.1 us a layer |
| reduction fixed, bandwidth eff. | 8.6 us, 0.42 | eager profile: reduce_kernel 9.03 us mean over [32, 4096] fp32 (latency-bound); log_softmax over [32, 128256] fp32 32.1 us |
| cat, gather, scatter fixed | 1.5, 1.8, 1.8 us | eager profile: CatArrayBatchedCopy 1.54 us, vectorized_gather 1.85 us |
| bandwidth eff. of the others | 0.8 | assumed (their decode tensors are far too small for it to show) |
| eager_launch_s | 21 us | the eager step's wall time: 30.51 ms median (prof-eager), host-bound, less the engine's own host work, over its ~1,430 launches |
| graph_node_s | 0.35 us | the graph step's wall time: 11.56 ms median (prof-graphs), less the engine's host work and the kernels' own time, over the graph's ~1,390 nodes |
| graph_launch_s | 10 us | assumed (one cudaGraphLaunch) |
| ENGINE_HOST_S | 1.35 ms | not part of the simulated device: the in-process engine's host work per step beside the forward (offline records: median step - median forward, Llama-3-8B 11.82 - 10.47 ms); only the calibration tests use it, to compare the engine's wall times |

The same constants serve every simulated GPU; only the H100 was measured.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass(frozen=True, slots=True)
class OpClassCost:
    fixed_s: float
    bandwidth_efficiency: float = 0.8
    flops_efficiency: float = 0.75


FUSED_FIXED_S = 8.9e-6  # bench.calibration's fit to the 2026-11-27 run


def _h100_op_classes(fused_fixed_s: float = FUSED_FIXED_S) -> dict[str, OpClassCost]:
    return {
        "gemm": OpClassCost(2.7e-6, 0.83, 0.75),
        "attention": OpClassCost(2.0e-6, 0.80, 0.5),
        "kv_write": OpClassCost(1.9e-6),
        "fused": OpClassCost(fused_fixed_s),
        "elementwise": OpClassCost(1.3e-6),
        "strided": OpClassCost(2.4e-6),
        "reduction": OpClassCost(8.6e-6, 0.42),
        "cat": OpClassCost(1.5e-6),
        "gather": OpClassCost(1.8e-6),
        "scatter": OpClassCost(1.8e-6),
    }


@dataclass(frozen=True, slots=True)
class Calibration:
    op_classes: dict[str, OpClassCost] = field(default_factory=_h100_op_classes)
    eager_launch_s: float = 21e-6  # host time per kernel launched eagerly
    graph_node_s: float = 0.35e-6  # device time between two kernels of a replayed graph
    graph_launch_s: float = 10e-6  # host time to launch a captured graph


def with_fused_fixed_s(calibration: Calibration, fused_fixed_s: float) -> Calibration:
    return replace(calibration, op_classes={**calibration.op_classes,
                                            "fused": OpClassCost(fused_fixed_s)})


H100_CALIBRATION = Calibration()
H100_2026_11_26 = with_fused_fixed_s(H100_CALIBRATION, 1.9e-6)
ENGINE_HOST_S = 1.35e-3
