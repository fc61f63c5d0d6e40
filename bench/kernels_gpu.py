"""Paged decode attention: achieved HBM bandwidth of each backend, against the torch backend.

A decode step reads every sequence's whole K/V once, so the kernel is memory-bound and its figure
of merit is bytes read ÷ time (K/V of all context positions + Q), as a fraction of the device's
peak. Backends, on the same cache and metadata in one run:
  - torch:           gather through the block tables + scaled_dot_product_attention (the baseline)
  - triton:          the Triton backend's policy (split-KV flash-decoding for long contexts)
  - triton-unified:  the unified kernel alone (one program per sequence × KV head)
  - triton-split:    the split-KV pair whatever the batch (the policy takes the unified kernel
                     past triton_ops.SPLIT_KV_MAX_PROGRAMS programs)
  - flash_attn:      when installed (it pages natively only with block_size % 256 == 0)
The metadata is reused across iterations, as every layer after the first of a step does.

    python -m bench.kernels_gpu                               # H100-class defaults
    python -m bench.kernels_gpu --batch-size 256 --context-len 200 --num-kv-heads 32 \
        --head-size 64 --graph-bound 8192           # as a decode graph captured to 8192 runs it
    python -m bench.kernels_gpu --device cpu --small          # smoke run (Triton interpreter)
"""

from __future__ import annotations

import argparse
import os
import re
import time

import torch

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Peak HBM bandwidth (GB/s) by device name, for drivers whose properties lack memory clocks.
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350,
             "A100-SXM4-80GB": 2039, "A100-SXM4-40GB": 1555, "A100 80GB PCIe": 1935,
             "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "A10": 600, "RTX 4090": 1008}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run")
    p.add_argument("--dtype", default="float16", choices=list(DTYPES))
    p.add_argument("--batch-size", type=int, default=32, help="decoding sequences (>= 16)")
    p.add_argument("--context-len", type=int, default=4096, help="tokens per sequence (>= 2048)")
    p.add_argument("--num-heads", type=int, default=32)
    p.add_argument("--num-kv-heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backends", default="torch,triton,triton-unified,flash_attn",
                   help="comma-separated; unavailable ones are reported and skipped")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--peak-gbps", type=float, default=None, help="override the device's peak")
    p.add_argument("--graph-bound", type=int, default=0,
                   help="time the kernels as a decode CUDA graph runs them: launched for "
                        "sequences of this length (the capture bound), real lengths on the "
                        "device; any --context-len up to it then")
    p.add_argument("--small", action="store_true",
                   help="tiny shapes and few iterations: checks the script, measures nothing")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.small:
        args.batch_size, args.context_len, args.iters, args.warmup = 2, 40, 1, 1
        args.num_heads, args.num_kv_heads, args.head_size, args.block_size = 4, 2, 64, 8
    elif args.device == "cpu":
        p.error("on CPU the Triton kernels only run interpreted: pass --small for a smoke run")
    elif args.graph_bound and not args.context_len <= args.graph_bound:
        p.error(f"--context-len {args.context_len} exceeds --graph-bound {args.graph_bound}")
    elif not args.graph_bound and (args.batch_size < 16 or args.context_len < 2048):
        p.error(f"--batch-size >= 16 and --context-len >= 2048 (got {args.batch_size}, "
                f"{args.context_len}); use --small for a smoke run")
    if args.device == "cpu":
        args.dtype = "float32"
    return args


def peak_gbps(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device)
    clock_khz, bus_bits = getattr(props, "memory_clock_rate", 0), getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9  # double data rate
    return next((gbps for name, gbps in PEAK_GBPS.items() if name in props.name), None)


def make_decode_step(args: argparse.Namespace, device: torch.device, dtype: torch.dtype):
    """Cache with every sequence's context in shuffled blocks, and a decode-only metadata."""
    from pagedserve.kernels.metadata import AttentionMetadata
    from pagedserve.services.common.cdiv import cdiv

    gen = torch.Generator().manual_seed(args.seed)
    blocks_per_seq = cdiv(args.context_len, args.block_size)
    num_blocks = args.batch_size * blocks_per_seq
    k_cache, v_cache = (torch.randn(num_blocks, args.block_size, args.num_kv_heads,
                                    args.head_size, generator=gen).to(device, dtype)
                        for _ in range(2))  # [num_blocks, block_size, kv_heads, head]
    block_tables = torch.randperm(num_blocks, generator=gen).view(args.batch_size, blocks_per_seq)
    seq_lens = [args.context_len] * args.batch_size
    last = torch.tensor([args.context_len - 1] * args.batch_size)
    slots = block_tables.gather(1, (last // args.block_size).unsqueeze(1)).squeeze(1)
    meta = AttentionMetadata(
        slot_mapping=(slots * args.block_size + last % args.block_size).to(device),
        block_tables=block_tables.to(device, torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(args.batch_size + 1, dtype=torch.int32, device=device),
        max_query_len=1, max_seq_len=args.context_len, num_prefills=0, num_prefill_tokens=0,
        query_lens_cpu=[1] * args.batch_size, seq_lens_cpu=seq_lens)
    if args.graph_bound:  # the host fields a capture sets (cuda_graphs.DecodeBuffers.metadata)
        meta.max_seq_len = args.graph_bound
        meta.seq_lens_cpu = [args.graph_bound] * args.batch_size
    query = torch.randn(args.batch_size, args.num_heads, args.head_size,
                        generator=gen).to(device, dtype)  # [batch, heads, head]
    return query, k_cache, v_cache, meta


def load_backend(name: str, device: torch.device):
    """The backend's ops, or None when it cannot run on this device."""
    from pagedserve.kernels.backend import available_backends, get_backend

    base = name.split("-")[0]
    if base not in available_backends(device):
        return None
    module = get_backend(base, device)
    if name == "triton-unified":  # the split-KV path off: one partition is the whole context
        module = _Patched(module, "DECODE_PARTITION_SIZE", 1 << 30)
    elif name == "triton-split":
        module = _Patched(module, "SPLIT_KV_MAX_PROGRAMS", 1 << 30)
    return module


class _Patched:
    """The Triton backend with one of its launch-policy constants set otherwise."""

    def __init__(self, module, name: str, value: int) -> None:
        self.module, self.name, self.value = module, name, value

    def paged_attention(self, *args):
        saved = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)
        try:
            return self.module.paged_attention(*args)
        finally:
            setattr(self.module, self.name, saved)


def time_backend(ops, query, k_cache, v_cache, meta, scale, args, device) -> tuple[float, torch.Tensor]:
    """Mean seconds per call, and the output."""
    meta.derived.clear()  # each backend builds its own plan, once, as in the first layer
    for _ in range(args.warmup):
        out = ops.paged_attention(query, k_cache, v_cache, meta, scale)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(args.iters):
            out = ops.paged_attention(query, k_cache, v_cache, meta, scale)
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / args.iters, out
    t0 = time.perf_counter()
    for _ in range(args.iters):
        out = ops.paged_attention(query, k_cache, v_cache, meta, scale)
    return (time.perf_counter() - t0) / args.iters, out


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        # Triton runs on CPU tensors only in its interpreter, read when the kernels are defined.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from bench.common import write_record

    torch.manual_seed(args.seed)
    dtype = DTYPES[args.dtype]
    query, k_cache, v_cache, meta = make_decode_step(args, device, dtype)
    scale = args.head_size ** -0.5
    kv_row_numel = args.num_kv_heads * args.head_size  # one position's K (or V)
    bytes_read = (2 * kv_row_numel * args.context_len * args.batch_size
                  + query.numel()) * k_cache.element_size()
    peak = args.peak_gbps or peak_gbps(device)

    results, baseline = [], None
    for name in args.backends.split(","):
        ops = load_backend(name, device)
        if ops is None:
            print(f"{name:16s} unavailable on {device}")
            continue
        seconds, out = time_backend(ops, query, k_cache, v_cache, meta, scale, args, device)
        baseline = out if baseline is None else baseline
        gbps = bytes_read / seconds / 1e9
        result = {"backend": name, "time_us": seconds * 1e6, "gbps": gbps,
                  "peak_fraction": gbps / peak if peak else None,
                  "max_abs_diff_vs_first_backend": (out.float() - baseline.float()).abs().max().item()}
        results.append(result)
    torch_time = next((r["time_us"] for r in results if r["backend"] == "torch"), None)
    for r in results:
        r["speedup_vs_torch"] = torch_time / r["time_us"] if torch_time else None
        peak_text = f"{r['peak_fraction']:.0%} of peak" if r["peak_fraction"] else "peak unknown"
        speedup = f"{r['speedup_vs_torch']:.2f}x torch" if r["speedup_vs_torch"] else ""
        print(f"{r['backend']:16s} {r['time_us']:10.1f} us  {r['gbps']:8.1f} GB/s  {peak_text}  "
              f"{speedup}  (max |diff| {r['max_abs_diff_vs_first_backend']:.2e})")

    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record = {"device_name": device_name, "peak_gbps": peak, "bytes_read": bytes_read,
              "config": {k: v for k, v in vars(args).items() if k != "backends"},
              "results": results}
    if not args.small:  # a smoke run measures nothing worth keeping
        tag = re.sub(r"[^A-Za-z0-9]+", "-", device_name).strip("-").lower()
        if args.graph_bound:  # not the default record, which the GPU check writes
            tag += (f"-b{args.batch_size}-ctx{args.context_len}-kv{args.num_kv_heads}"
                    f"-bound{args.graph_bound}")
        print(f"wrote {write_record('kernels_gpu', record, tag=tag)}")
    return record


if __name__ == "__main__":
    main()
