"""The Triton kernels' cost as the compiler sees it, without a GPU: every launch the worker makes,
compiled ahead of time for sm_80 and sm_90 (`kernels.triton_aot`), summarized per kernel and
architecture (registers, spills, shared memory, theoretical occupancy), beside the bytes a
Llama-3-8B decode step must move and the H100 roofline they imply. Compiler output, not
measurements. Prints the markdown of docs/gpu-readiness.md; the record goes to
bench/results/kernels_aot.json.

    python -m bench.kernels_aot           # head 128 fully, the extremes of the rest
    python -m bench.kernels_aot --full    # every head size x block size x GQA ratio 1-8
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import triton

from bench.common import write_record

H100_BANDWIDTH_BYTES_S = 3.35e12  # SXM, HBM3
H100_NUM_SMS = 132
HBM_LATENCY_S = 600e-9  # loaded latency assumed for Little's law
# Shown in the kernel table: Llama-3-8B's shape (head 128, GQA 4) at block size 16.
SHOWN = dict(dtype="bf16", head_size=128, block_size=16, gqa=4)


@dataclass(frozen=True, slots=True)
class ModelShape:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    vocab_size: int

    def weight_bytes_per_step(self, dtype_bytes: int = 2) -> int:
        """Every weight but the embedding table (a gather of batch rows) is read each step."""
        attention = self.hidden_size * self.head_size * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        norms = 2 * self.hidden_size
        per_layer = attention + mlp + norms
        return (self.num_layers * per_layer + self.vocab_size * self.hidden_size
                + self.hidden_size) * dtype_bytes

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        return self.num_layers * 2 * self.num_kv_heads * self.head_size * dtype_bytes


LLAMA_3_8B = ModelShape("Llama-3-8B", num_layers=32, hidden_size=4096, intermediate_size=14336,
                        num_heads=32, num_kv_heads=8, head_size=128, vocab_size=128256)


def kernel_rows(reports: list[dict]) -> list[str]:
    rows = ["| kernel (phase) | arch | warps × stages, tile | registers | spills (B) | shared KB "
            "(at 1 stage) | programs/SM | warps/SM (occupancy) | worst over the matrix: "
            "registers, shared KB, occupancy |", "|" + " --- |" * 9]
    keys = sorted({(r["kernel"], r["phase"], r["arch"]) for r in reports},
                  key=lambda k: (k[0], k[1], k[2]))
    for kernel, phase, arch in keys:
        group = [r for r in reports if (r["kernel"], r["phase"], r["arch"]) == (kernel, phase, arch)]
        shown = next((r for r in group if all(r[k] == v for k, v in SHOWN.items())), group[0])
        unpipelined = shown["shared_unpipelined_bytes"]
        shared = f"{shown['shared_bytes'] / 1024:.1f}" + (
            f" ({unpipelined / 1024:.1f})" if unpipelined is not None else "")
        tile = shown["constexprs"].get("TILE_N")
        rows.append(
            f"| `{kernel}` ({phase}) | sm_{arch} | {shown['num_warps']} × {shown['num_stages']}"
            f"{f', {tile}' if tile else ''} | {shown['registers']} | "
            f"{shown['stack_bytes'] + shown['local_bytes']} | {shared} | "
            f"{shown['programs_per_sm']} | {shown['warps_per_sm']} ({shown['occupancy']:.0%}) | "
            f"{max(r['registers'] for r in group)}, "
            f"{max(r['shared_bytes'] for r in group) / 1024:.1f}, "
            f"{min(r['occupancy'] for r in group):.0%} |")
    return rows


def roofline_rows(reports: list[dict], model: ModelShape, batch: int, context: int,
                  partition_size: int) -> list[str]:
    weights = model.weight_bytes_per_step()
    kv = batch * context * model.kv_bytes_per_token()
    step_s = (weights + kv) / H100_BANDWIDTH_BYTES_S
    kv_layer = kv // model.num_layers
    partition = next(r for r in reports if r["kernel"] == "decode_partition_kernel"
                     and r["arch"] == 90 and all(r[k] == v for k, v in SHOWN.items()))
    resident = H100_NUM_SMS * partition["programs_per_sm"]
    grid = batch * model.num_kv_heads * triton.cdiv(context, partition_size)
    prefetch = partition["shared_bytes"] - partition["shared_unpipelined_bytes"]
    needed = H100_BANDWIDTH_BYTES_S * HBM_LATENCY_S / H100_NUM_SMS
    return [
        "| quantity | value |", "| --- | --- |",
        f"| weights read per step (bf16, all but the embedding gather) | {weights / 1e9:.2f} GB |",
        f"| KV read per step ({batch} × {context} tokens × {model.kv_bytes_per_token() // 1024} "
        f"KiB) | {kv / 1e9:.2f} GB |",
        f"| step at the roofline ({H100_BANDWIDTH_BYTES_S / 1e12:.2f} TB/s) | "
        f"{step_s * 1e3:.2f} ms → ≤ {batch / step_s:,.0f} tokens/s |",
        f"| attention per layer: KV bytes, time at the roofline | {kv_layer / 1e6:.0f} MB, "
        f"{kv_layer / H100_BANDWIDTH_BYTES_S * 1e6:.0f} µs |",
        f"| split-KV grid vs resident programs (sm_90) | {grid} programs, "
        f"{resident} resident ({H100_NUM_SMS} SMs × {partition['programs_per_sm']}): "
        f"{grid / resident:.2f} waves |",
        f"| bytes in flight per SM needed (Little: bandwidth × {HBM_LATENCY_S * 1e9:.0f} ns ÷ "
        f"SMs) | {needed / 1024:.1f} KB |",
        f"| K/V prefetched per SM by the pipelined partition kernel (programs × extra buffers) "
        f"| {partition['programs_per_sm'] * prefetch / 1024:.0f} KB |",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--full", action="store_true", help="every head size x block size x "
                        "GQA ratio 1-8 (default: head 128 and the extremes of the rest)")
    parser.add_argument("--jobs", type=int, default=2, help="compiler processes")
    parser.add_argument("--batch", type=int, default=32, help="decode batch for the roofline")
    parser.add_argument("--context", type=int, default=2048, help="context per sequence")
    parser.add_argument("--tag", default="", help="suffix of the record's file name")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this compiles for real GPUs")
    from pagedserve.kernels import triton_ops
    from pagedserve.kernels.triton_aot import compile_matrix, report_dict

    reports = [report_dict(r) for r in compile_matrix(args.full, args.jobs)]
    kernels = kernel_rows(reports)
    roofline = roofline_rows(reports, LLAMA_3_8B, args.batch, args.context,
                             triton_ops.DECODE_PARTITION_SIZE)
    path = write_record("kernels_aot", {"args": vars(args), "triton": triton.__version__,
                                        "source": "compiler output (ptxas, cuobjdump), not "
                                                  "measurements", "kernel_table": kernels,
                                        "roofline_table": roofline, "results": reports},
                        args.tag)
    print(f"Triton {triton.__version__}, compiled for sm_80 and sm_90 — compiler output, not "
          f"measurements. Shown: {SHOWN}.\n")
    print("\n".join(kernels) + "\n")
    print(f"{LLAMA_3_8B.name} decode, batch {args.batch} at {args.context} context, H100 SXM:\n")
    print("\n".join(roofline))
    print(f"\nrecorded {path}")


if __name__ == "__main__":
    main()
