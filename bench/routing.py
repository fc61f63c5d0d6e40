"""Routing: a prefix-heavy chat workload over two engine replicas, with affinity routing and with
round robin, same run.

Two replicas (a worker and its scheduler each, prefix caching on) and two gateways in front of
both, one per policy, all in this process over loopback. The workload: a few long system prompts
shared by many conversations, each conversation several turns, every turn's prompt the previous
one plus the answer it got and a new user message (so a turn's prompt extends the one before it
and its generated tokens, whose blocks the replica that ran it has cached). Each of N clients plays one conversation at a time, turn after turn. The two policies get
workloads of the same shape with different tokens, so neither finds the other's blocks cached.

Reported per policy: prefix-cache hit tokens (the prompt tokens the schedulers served from their
cache, as the gateways' usage reports them), output tokens/s, and the gateway's routing decision
time per request (p50, p99: choosing a replica from the live set); then affinity ÷ round robin
(targets: >= 1.8x hit tokens, throughput not lower; routing p50 <= 1 ms).

    python -m bench.routing                     # SmolLM2, 8 clients
    python -m bench.routing --quick --tag quick
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from collections import deque
from dataclasses import dataclass, field

import grpc
from pagedserve.scheduler_svc.servicer import start_scheduler, stop_scheduler
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    GatewayConfig,
    HttpConfig,
    ModelConfig,
    RoutingConfig,
    SchedulerConfig,
    SchedulerServiceConfig,
    WorkerServiceConfig,
)
from pagedserve.services.gateway.app import Gateway, start_gateway
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pagedserve.worker_svc.servicer import start_worker

from bench.common import DEFAULT_MODEL, finish, percentiles, quiet_logging

POLICIES = ("affinity", "round-robin")


@dataclass(slots=True)
class Conversation:
    system: list[int]
    user_turns: list[list[int]]  # token ids of each user message


@dataclass(slots=True)
class PolicyResult:
    policy: str
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    elapsed_s: float = 0.0
    routing_us: dict[str, float] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0


def make_conversations(args: argparse.Namespace, salt: int) -> list[Conversation]:
    rng = random.Random(1000 * args.seed + salt)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(n)]

    systems = [tokens(args.system_len) for _ in range(args.num_system_prompts)]
    return [Conversation(rng.choice(systems), [tokens(args.user_len) for _ in range(args.num_turns)])
            for _ in range(args.num_conversations)]


async def _client(stub, queue: deque[Conversation], max_tokens: int, result: PolicyResult,
                  prompts: list[list[int]]) -> None:
    while queue:
        conversation = queue.popleft()
        history = list(conversation.system)
        for user in conversation.user_turns:
            history += user
            prompts.append(list(history))
            response = await stub.Generate(gateway_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(token_ids=history),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                   ignore_eos=True)), timeout=600)
            result.num_requests += 1
            result.num_prompt_tokens += response.usage.prompt_tokens
            result.num_cached_tokens += response.usage.cached_tokens
            result.num_output_tokens += response.usage.completion_tokens
            history += response.outputs[0].token_ids


async def run_policy(gateway: Gateway, conversations: list[Conversation], args: argparse.Namespace,
                     policy: str) -> PolicyResult:
    result = PolicyResult(policy)
    queue = deque(conversations)
    prompts: list[list[int]] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(_client(stub, queue, args.output_len, result, prompts)
                               for _ in range(args.concurrency)))
        result.elapsed_s = time.perf_counter() - start
    result.routing_us = await routing_time_us(gateway, prompts)
    return result


async def routing_time_us(gateway: Gateway, prompts: list[list[int]]) -> dict[str, float]:
    """What one routing decision costs the gateway: the replica set's choice over the live
    replicas (their pushed loads) for each prompt the run sent."""
    times_us = []
    for prompt in prompts:
        start = time.perf_counter()
        await gateway.replicas.choose(prompt, set(), 1.0)
        times_us.append((time.perf_counter() - start) * 1e6)
    return percentiles(times_us)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=args.model, dtype="float32"),
                        cache=CacheConfig(kv_cache_memory_gib=args.kv_cache_memory_gib,
                                          swap_space_gib=0.01, enable_prefix_caching=True),
                        scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency, 1)),
                        device=DeviceConfig(device="cpu"))


async def run(args: argparse.Namespace) -> list[PolicyResult]:
    config = engine_config(args)
    replicas = []
    gateways: list[Gateway] = []
    try:
        for _ in range(2):
            worker = await start_worker(config, WorkerServiceConfig(port=0))
            scheduler = await start_scheduler(config, SchedulerServiceConfig(
                port=0, worker_addresses=[f"127.0.0.1:{worker[0].port}"], stats_interval_s=0))
            replicas.append((worker, scheduler))
        addresses = ",".join(f"127.0.0.1:{s[0].port}" for _, s in replicas)
        for policy in POLICIES:
            gateways.append(await start_gateway(GatewayConfig(
                port=0, scheduler_address=addresses, http=HttpConfig(http_port=-1),
                routing=RoutingConfig(routing_policy=policy))))
            while len(gateways[-1].replicas.serving()) < 2:
                await asyncio.sleep(0.05)
        return [await run_policy(gateway, make_conversations(args, salt), args, policy)
                for salt, (policy, gateway) in enumerate(zip(POLICIES, gateways, strict=True))]
    finally:
        for gateway in gateways:
            await gateway.stop(grace_s=0)
        for worker, scheduler in replicas:
            await stop_scheduler(*scheduler)
            await worker[0].shutdown(0)
            worker[1].close()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--quick", action="store_true", help="a small run (minutes on a CPU)")
    parser.add_argument("--num-system-prompts", type=int, default=4)
    parser.add_argument("--system-len", type=int, default=128)
    parser.add_argument("--num-conversations", type=int, default=24)
    parser.add_argument("--num-turns", type=int, default=6)
    parser.add_argument("--user-len", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--kv-cache-memory-gib", type=float, default=0.12)
    parser.add_argument("--min-token-id", type=int, default=3)
    parser.add_argument("--max-token-id", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    if parser.parse_args(argv).quick:  # smaller defaults; flags given still win
        parser.set_defaults(system_len=96, num_conversations=8, num_turns=3, output_len=8,
                            concurrency=4)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    logging.getLogger("pagedserve").setLevel(logging.WARNING)
    affinity, round_robin = asyncio.run(run(args))
    hit_ratio = affinity.num_cached_tokens / max(round_robin.num_cached_tokens, 1)
    throughput_ratio = affinity.output_tok_s / max(round_robin.output_tok_s, 1e-9)
    line = (f"routing: affinity {affinity.num_cached_tokens} hit tokens, "
            f"{affinity.output_tok_s:.1f} tok/s; round-robin {round_robin.num_cached_tokens} "
            f"hit tokens, {round_robin.output_tok_s:.1f} tok/s; hit tokens x{hit_ratio:.2f} "
            f"(target >= 1.8), throughput x{throughput_ratio:.2f} (target >= 1.0), routing "
            f"p50 {affinity.routing_us['p50']:.1f} us (target <= 1000)")
    return finish("routing", args, line, [affinity, round_robin],
                  hit_token_ratio=hit_ratio, throughput_ratio=throughput_ratio,
                  targets={"hit_token_ratio": 1.8, "throughput_ratio": 1.0,
                           "routing_p50_us": 1000})


if __name__ == "__main__":
    main()
