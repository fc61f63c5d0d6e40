"""The host-memory KV tier on the simulated GPU: prompts whose shared prefixes together hold
--cache-multiple times the device's KV cache, each prefix asked --rounds times round-robin (a
new tail each time), so an LRU over the device alone evicts every prefix before it comes back.
The requests in flight hold part of the device (about half at the defaults): past all of it, arrivals
wait for blocks whatever the tier does (with 12 prefixes of 1024 tokens, 4 in flight needed 264
of 256 blocks and one arrival in three waited).
Prefix hit tokens and TTFT with --kv-offload-gib against without (issue 34: hit tokens >= 2x,
TTFT p50 <= 0.6x). TTFT is given over every request and over the repeats (rounds after the
first: a host-tier hit with the tier, a recompute without), since no tier serves a first round.

The engine is EngineCore behind LLMEngine in process, on `--device sim` at real speed
(sim_time_scale 1: a step takes the modelled time of its kernels and its block copies over
PCIe), --concurrency requests in flight. The record goes to bench/results/host_tier-<tag>.json.

    python -m bench.host_tier
    python -m bench.host_tier --num-prefixes 6 --rounds 2 --tag smoke
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import deque

from pagedserve.scheduler_svc.stats import FinishedRequestStats, StepStats
from pagedserve.services.common.sampling_params import SamplingParams

from bench.common import finish, percentiles, quiet_logging
from pagedserve.llm_engine import LLMEngine


def workload(args: argparse.Namespace, vocab_size: int) -> list[list[int]]:
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(1000, vocab_size - 1000) for _ in range(n)]

    prefixes = [tokens(args.prefix_len) for _ in range(args.num_prefixes)]
    return [p + tokens(args.tail_len) for _ in range(args.rounds) for p in prefixes]


class QueueTimes:
    """A StatLogger of the time each request waited before it was first scheduled: for KV blocks
    (at 4 in flight the device holds 3 of these requests) and for the steps already in flight
    when it arrived."""

    def __init__(self) -> None:
        self.queue_s: list[float] = []

    def record_step(self, stats: StepStats) -> None:
        pass

    def record_finished(self, stats: FinishedRequestStats) -> None:
        self.queue_s.append(stats.queue_time_s)


def run(args: argparse.Namespace, offload_gib: float) -> dict:
    engine = LLMEngine.from_kwargs(
        device="sim", sim_gpu=args.gpu, sim_model=args.sim_model, sim_time_scale=1.0,
        block_size=args.block_size, num_gpu_blocks_override=args.num_gpu_blocks,
        enable_prefix_caching=True, kv_offload_gib=offload_gib, swap_space_gib=1.0,
        max_num_seqs=args.concurrency, seed=args.seed)
    core = engine.core
    queued = QueueTimes()
    core.stat_loggers.append(queued)
    prompts = workload(args, core.vocab_size)
    sampling = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    queue = deque(range(len(prompts)))
    sent: dict[str, float] = {}
    ttft: dict[str, float] = {}

    def submit() -> None:
        i = queue.popleft()
        sent[f"r{i}"] = time.perf_counter()
        engine.add_request(f"r{i}", prompts[i], sampling)

    start = time.perf_counter()
    for _ in range(min(args.concurrency, len(queue))):
        submit()
    while engine.has_unfinished_requests():
        for report in engine.step():
            if report.request_id not in ttft and report.outputs and report.outputs[0].token_ids:
                ttft[report.request_id] = time.perf_counter() - sent[report.request_id]
            if report.finished and queue:
                submit()
    elapsed = time.perf_counter() - start
    bm = core.block_manager
    host = bm.host_tier
    engine.close()
    return {"kv_offload_gib": offload_gib, "num_offload_blocks": core.num_offload_blocks,
            "num_requests": len(prompts), "elapsed_s": round(elapsed, 3),
            "prefix_cache_queries": bm.prefix_cache_queries,
            "prefix_cache_hits": bm.prefix_cache_hits,
            "host_hit_tokens": host.num_hit_tokens if host else 0,
            "offloaded_blocks": host.num_offloaded_blocks if host else 0,
            "onloaded_blocks": host.num_onloaded_blocks if host else 0,
            "ttft_s": percentiles(list(ttft.values())),
            "ttft_repeat_s": percentiles([ttft[f"r{i}"] for i in range(args.num_prefixes,
                                                                       len(prompts))]),
            "queue_s": percentiles(queued.queue_s)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--sim-model", default="Llama-3-8B")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-gpu-blocks", type=int, default=512)
    parser.add_argument("--cache-multiple", type=float, default=3.0,
                        help="the prefixes' blocks over the device's")
    parser.add_argument("--num-prefixes", type=int, default=24,
                        help="24 at the defaults: 4 requests in flight hold about half the device")
    parser.add_argument("--tail-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--kv-offload-gib", type=float, default=4.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="sim")
    args = parser.parse_args(argv)
    args.prefix_len = int(args.cache_multiple * args.num_gpu_blocks * args.block_size
                          / args.num_prefixes) // args.block_size * args.block_size
    blocks_per_request = -(-(args.prefix_len + args.tail_len + args.output_len)
                           // args.block_size)
    args.in_flight_device_share = args.concurrency * blocks_per_request / args.num_gpu_blocks
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    load_at_start = round(os.getloadavg()[0], 2)
    without, tiered = run(args, 0.0), run(args, args.kv_offload_gib)
    hits = (tiered["prefix_cache_hits"] / without["prefix_cache_hits"]
            if without["prefix_cache_hits"] else None)
    ttft = tiered["ttft_s"]["p50"] / without["ttft_s"]["p50"]
    repeat = tiered["ttft_repeat_s"]["p50"] / without["ttft_repeat_s"]["p50"]
    line = (f"host_tier: {args.num_prefixes} prefixes of {args.prefix_len} tokens "
            f"({args.cache_multiple:g}x the device's {args.num_gpu_blocks} blocks; "
            f"{args.concurrency} in flight hold {args.in_flight_device_share:.0%} of it), "
            f"{args.rounds} rounds: prefix hit tokens {tiered['prefix_cache_hits']} vs "
            f"{without['prefix_cache_hits']} without the tier "
            f"({'none without' if hits is None else f'{hits:.1f}x'}), TTFT p50 "
            f"{tiered['ttft_s']['p50'] * 1e3:.1f} ms vs {without['ttft_s']['p50'] * 1e3:.1f} ms "
            f"({ttft:.2f}x), of the repeats {tiered['ttft_repeat_s']['p50'] * 1e3:.1f} ms vs "
            f"{without['ttft_repeat_s']['p50'] * 1e3:.1f} ms ({repeat:.2f}x); queued before "
            f"the first step (p50) {tiered['queue_s']['p50'] * 1e3:.1f} ms vs "
            f"{without['queue_s']['p50'] * 1e3:.1f} ms")
    return finish("host_tier", args, line, [without, tiered],
                  hit_tokens_ratio=hits and round(hits, 3), ttft_p50_ratio=round(ttft, 3),
                  ttft_repeat_p50_ratio=round(repeat, 3),
                  load_average_1m_at_start=load_at_start)


if __name__ == "__main__":
    main()
