"""Would a disk tier behind the host tier pay? What a prefix hit costs on the simulated GPU when
its KV comes from the device, the host tier, or a disk, against recomputing it, by prefix length
and disk read bandwidth.

A workload whose prefixes hold 10x the device cache, asked round-robin, with a host tier of 3x
keeps nothing: the LRU over both tiers (4x) evicts every prefix before it comes back
(bench.host_tier --cache-multiple 10 measures it), so every hit past the host tier would be a
disk hit. Whether that pays is the time to read a prefix's blocks from the disk and copy them to
the device against the prefill that recomputes them. The times are the simulated worker's
models (worker_svc/sim: the step's kernels, blocks over the host link); the disk's, its blocks'
bytes over the read bandwidth given, before the host-to-device copy (a disk cannot feed the
device directly here).

    python -m bench.disk_tier
"""

from __future__ import annotations

import argparse

from pagedserve.services.common.config import CacheConfig, DeviceConfig, EngineConfig, ModelConfig
from pagedserve.worker_svc.sim.worker import SimWorker

from bench.common import DEFAULT_MODEL, finish, quiet_logging


def hit_costs(worker: SimWorker, prefix_len: int, tail_len: int,
              disk_bandwidths: list[float]) -> dict:
    """Modelled seconds to the first token of a prompt whose prefix is recomputed or hit in
    each tier."""
    step_model, roofline = worker.step_model, worker.roofline
    spec = worker.kv_spec
    num_blocks = prefix_len // spec.block_size

    def step_s(query_len: int, context_len: int) -> float:
        return step_model.step([query_len], [context_len], 1).device_s

    tail_s = step_s(tail_len, prefix_len)
    host_s = roofline.block_moves_s(num_blocks, 0, spec.bytes_per_block)
    recompute_s = step_s(prefix_len + tail_len, 0)
    disk = {f"{bandwidth / 1e9:g}GB/s": num_blocks * spec.bytes_per_block / bandwidth + host_s
            + tail_s for bandwidth in disk_bandwidths}
    return {"prefix_len": prefix_len, "recompute_s": recompute_s, "gpu_hit_s": tail_s,
            "host_hit_s": host_s + tail_s, "disk_hit_s": disk,
            "disk_over_recompute": {k: round(v / recompute_s, 3) for k, v in disk.items()}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--sim-model", default="Llama-3-8B")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[1024, 4096, 16384, 32768])
    parser.add_argument("--tail-len", type=int, default=16)
    parser.add_argument("--disk-gbps", type=float, nargs="+", default=[3.0, 7.0, 14.0],
                        help="disk read bandwidths, GB/s (PCIe 3, 4, 5 NVMe drives)")
    parser.add_argument("--tag", default="sim")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    worker = SimWorker(EngineConfig(
        model=ModelConfig(model=DEFAULT_MODEL),
        cache=CacheConfig(block_size=args.block_size, num_gpu_blocks_override=16,
                          num_cpu_blocks_override=1),
        device=DeviceConfig(device="sim", sim_gpu=args.gpu, sim_model=args.sim_model)))
    worker.load_model()
    results = [hit_costs(worker, n, args.tail_len, [g * 1e9 for g in args.disk_gbps])
               for n in args.prefix_lens]
    line = "disk_tier: a prefix hit from disk / recomputing it, by prefix length: " + "; ".join(
        f"{r['prefix_len']} tokens " + ", ".join(
            f"{k} {v:.2f}x" for k, v in r["disk_over_recompute"].items())
        + f" (host tier {r['host_hit_s'] / r['recompute_s']:.2f}x)" for r in results)
    return finish("disk_tier", args, line, results)


if __name__ == "__main__":
    main()
