"""Prefill/decode disaggregation on the simulated GPU: running decodes beside 4k-token prefills,
on two replicas either way: colocated (`serve --data-parallel-size 2`, every replica does both)
or disaggregated (`serve --prefill-replicas 1 --decode-replicas 1`). The decode streams' inter-
token latency (ITL) p99 and the output throughput of each (issue 34: ITL p99 <= 0.5x of the
colocated run at the same throughput, +-10%).

The stack is `pagedserve serve` as processes on `--device sim` (`--sim-model` on `--sim-gpu`,
sim_time_scale 1: each step takes its kernels' modelled time), driven over gRPC
(GenerateStream, token ids). --num-decodes closed-loop streams of --decode-prompt-len tokens
and --decode-output-len outputs run throughout; a --prefill-len prompt (--prefill-output-len
outputs) arrives every --prefill-interval-s (modelled) for --duration-s (host seconds). With
--sim-time-scale S every modelled time is S times longer, so that the host's own delays (a
shared CPU) weigh S times less; latencies and throughputs are reported in modelled time, over
the window from the start to the deadline (the requests still running then end after it, with
fewer streams beside them, for as long as a decode request lasts: not the same work). A
transferred block costs the decode replica what a swap-in of it would (the simulated cache
prices it on the device's timeline, beside nothing). Its figures are models. The record goes to
bench/results/disaggregation-<tag>.json.

    python -m bench.disaggregation
    python -m bench.disaggregation --duration-s 10 --tag smoke

The committed record ran as `--prefill-interval-s 5.0 --sim-time-scale 10` when the interval was
in host seconds: the same 0.5 modelled seconds as the default now.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import time
from pathlib import Path

import grpc
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from bench.common import DEFAULT_MODEL, finish, percentiles, quiet_logging, serve_process
from bench.serving import wait_serving
from pagedserve.supervisor import free_port

MODES = {"colocated": ["--data-parallel-size", "2"],
         "disaggregated": ["--prefill-replicas", "1", "--decode-replicas", "1"]}


def _request(rng: random.Random, prompt_len: int, output_len: int
             ) -> gateway_pb2.GenerateStreamRequest:
    return gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=[rng.randrange(1000, 30000)
                                                 for _ in range(prompt_len)]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=output_len,
                                           ignore_eos=True))


async def _stream(stub, request) -> list[float]:
    """The arrival times of the request's token chunks."""
    times = []
    async for delta in stub.GenerateStream(request, timeout=600):
        if delta.token_ids:
            times.append(time.perf_counter())
    return times


async def _drive(address: str, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    itl: list[float] = []
    num_decode_tokens = num_prefill_tokens = 0  # that arrived before the deadline
    prefill_ttft: list[float] = []
    deadline = time.perf_counter() + args.duration_s
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)

        async def decodes() -> None:
            nonlocal num_decode_tokens
            while time.perf_counter() < deadline:
                times = await _stream(stub, _request(rng, args.decode_prompt_len,
                                                     args.decode_output_len))
                num_decode_tokens += sum(t <= deadline for t in times)
                itl.extend(b - a for a, b in itertools.pairwise(times) if b <= deadline)

        async def prefill() -> None:
            nonlocal num_prefill_tokens
            start = time.perf_counter()
            times = await _stream(stub, _request(rng, args.prefill_len, args.prefill_output_len))
            prefill_ttft.append(times[0] - start)
            num_prefill_tokens += sum(t <= deadline for t in times)

        warm = [_stream(stub, _request(rng, args.decode_prompt_len, 2)) for _ in range(2)]
        await asyncio.gather(*warm)
        start = time.perf_counter()
        streams = [asyncio.create_task(decodes()) for _ in range(args.num_decodes)]
        prefills = []
        while time.perf_counter() < deadline:
            prefills.append(asyncio.create_task(prefill()))
            await asyncio.sleep(args.prefill_interval_s * args.sim_time_scale)
        await asyncio.gather(*streams, *prefills)
        elapsed = time.perf_counter() - start
    # throughput and ITLs over the same window for both modes: the requests still running at the
    # deadline finish with fewer streams beside them, for as long as a decode request lasts
    window = deadline - start
    scale = args.sim_time_scale
    return {"elapsed_s": round(elapsed, 3), "window_s": round(window, 3),
            "num_prefills": len(prefill_ttft),
            "decode_itl_s": percentiles([t / scale for t in itl]),
            "prefill_ttft_s": percentiles([t / scale for t in prefill_ttft]),
            "output_tok_s": round((num_decode_tokens + num_prefill_tokens) / window * scale, 1),
            "prompt_tok_s": round(len(prefills) * args.prefill_len / window * scale, 1)}


def run(args: argparse.Namespace, mode: str) -> dict:
    port = free_port()
    flags = ["--model", args.model, "--port", str(port), "--http-port", "-1",
             "--no-internal-tls", "--device", "sim", "--sim-gpu", args.gpu,
             "--sim-model", args.sim_model, "--sim-time-scale", str(args.sim_time_scale),
             "--enable-prefix-caching",
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--log-level", "WARNING", *MODES[mode]]
    address = f"127.0.0.1:{port}"
    with serve_process(flags, Path.cwd()) as stack:
        wait_serving(address, stack, 300)
        time.sleep(2.0)  # the gateway sees every replica (and its role) serve
        return {"mode": mode, **asyncio.run(_drive(address, args))}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL, help="its tokenizer serves")
    parser.add_argument("--gpu", default="H100-SXM")
    parser.add_argument("--sim-model", default="Llama-3-8B")
    parser.add_argument("--sim-time-scale", type=float, default=10.0,
                        help="every modelled time times this: the host's own delays (a shared "
                             "CPU) weigh that much less; latencies are reported divided by it")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--num-decodes", type=int, default=16)
    parser.add_argument("--decode-prompt-len", type=int, default=256)
    parser.add_argument("--decode-output-len", type=int, default=128)
    parser.add_argument("--prefill-len", type=int, default=4096)
    parser.add_argument("--prefill-output-len", type=int, default=8)
    parser.add_argument("--prefill-interval-s", type=float, default=0.5, help="modelled")
    parser.add_argument("--duration-s", type=float, default=40.0, help="host seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="sim")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    load_at_start = round(os.getloadavg()[0], 2)
    colocated, disaggregated = run(args, "colocated"), run(args, "disaggregated")
    itl = disaggregated["decode_itl_s"]["p99"] / colocated["decode_itl_s"]["p99"]
    throughput = disaggregated["output_tok_s"] / colocated["output_tok_s"]
    line = (f"disaggregation (model: {args.sim_model} on a simulated {args.gpu}): "
            f"{args.num_decodes} decode streams beside a {args.prefill_len}-token prefill every "
            f"{args.prefill_interval_s:g} modelled s: decode ITL p99 "
            f"{disaggregated['decode_itl_s']['p99'] * 1e3:.1f} ms disaggregated vs "
            f"{colocated['decode_itl_s']['p99'] * 1e3:.1f} ms colocated ({itl:.2f}x), output "
            f"throughput {throughput:.2f}x")
    return finish("disaggregation", args, line, [colocated, disaggregated],
                  itl_p99_ratio=round(itl, 3), throughput_ratio=round(throughput, 3),
                  load_average_1m_at_start=load_at_start)


if __name__ == "__main__":
    main()
