"""Routing: prefix-heavy workloads over two engine replicas, with affinity routing and with round
robin, same run.

Two replicas (a worker and its scheduler each, prefix caching on) and two gateways in front of
both, one per policy, all in this process over loopback. Conversations share system prompts and
grow a turn at a time, each turn's prompt the previous one plus the answer it got and a new
message; `--num-open` of them are open at any time, and when one ends the next one starts. Each of
the `--concurrency` clients runs the next turn of an open conversation picked at random (seeded).
A conversation takes half to 1.5x `--num-turns` turns, so the open ones are at all depths. Both
policies get the same conversations and seeded turn picks, each on fresh replicas (their
schedulers restarted between the runs: empty caches), so the runs differ only in routing and
timing. Presets (`--workload`, both by default, one record; bench/routing_workload.py):

- `chat`: 12 system prompts (apps, personas) of 128 tokens, 32 chats of 6 turns on average,
  64-token user messages and 32-token answers, 16 open.
- `agent`: agent loops, whose history dwarfs the system prompt: each turn appends a tool result
  (256 tokens: a file excerpt, a command's output) and the model's next action (a tool call: 16
  tokens, which also keeps CPU decode in budget), 10 turns on average, 4 system prompts of 128
  tokens each shared by 5 of the 20 sessions, 10 open (tools answer in seconds).

Each replica's KV cache holds `--cache-fraction` of the steady state's footprint (every system
prompt, the open conversations' histories between turns, what the running turns add), which the
run also measures. What separates the policies is that pressure. Affinity keeps a conversation on
one replica, so the caches must hold the footprint once between them; round robin sends a turn to
its previous turn's replica about half the time, so to hit, each replica must hold a copy of every
conversation: twice the footprint. Where the caches hold it twice, round robin hits nearly as much
(a moved turn finds its history up to its last visit to that replica). Where they hold it once
but not twice, round robin loses its moved turns' histories, keeping their system prompts, and
affinity keeps everything: the ratio is then 2 / (1 + s), s = the system prompts' share of the
reusable tokens ("when moves miss" below).

Reported per preset and policy: prefix-cache hit tokens (as the gateways' usage reports them),
their share of the reusable tokens (a turn's system prompt once seen, and its history up to the
previous answer's last full block) and the misses by kind of turn (a conversation's first; later,
on its previous turn's replica or moved), output tokens/s, the routing decisions by reason and by
replica, the gateway's routing decision time (p50, p99), the footprint; then affinity / round
robin (targets: >= 1.8x hit tokens, throughput not lower, routing p50 <= 1 ms).

One run is one draw of which conversations grow long on which replica; bench/routing_replay.py
replays the same workload over a model of the caches for many seeds, to compare routing changes.

`--compare kv-events` runs affinity twice instead: on the replicas' KV events (the gateway's
default) and on the gateway's own index alone (`--no-routing-kv-events`); target: events >= the
index's hit tokens. `--restart-at F` restarts replica r0's scheduler (same port, same worker: a
new epoch, an empty prefix cache) once F of the turns are answered, in each run; the turns it was
running fail over to r1; target with a restart: events >= 1.2x the index. The line also gives
each arm's turns and preemptions per replica, its later turns' misses by when the chosen replica
lost the tokens (before the turn was routed, or after: queued behind other turns), and by how many
blocks the router's KV events were off the chosen replica's prefix cache when it routed (a late or
misnamed event shows there). `--compare index-twice` runs the own index in both
arms: the turns finish in an order the host's timing draws, so the same routing differs from run
to run, and this pair shows by how much. `--reverse` swaps the arms' order; `--arm NAME` runs one
arm alone (a full pair holds the bench lock too long on a shared host).

    python -m bench.routing --tag cpu            # both presets, SmolLM2, 8 clients
    python -m bench.routing --quick --tag quick  # both, small
    python -m bench.routing --workload agent --cache-fraction 0.7
    python -m bench.routing --workload agent --compare kv-events --restart-at 0.5 --tag restart
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Awaitable, Callable

import grpc
from pagedserve.scheduler_svc.servicer import start_scheduler, stop_scheduler
from pagedserve.services.common.block_hash import BlockHash, hash_prompt_blocks
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    SchedulerServiceConfig,
    WorkerServiceConfig,
)
from pagedserve.services.gateway.app import Gateway, start_gateway
from pagedserve.services.gateway.config import GatewayConfig, HttpConfig, RoutingConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pagedserve.worker_svc.servicer import start_worker

from bench.common import DEFAULT_MODEL, finish, percentiles, quiet_logging
from bench.routing_report import (
    PolicyResult,
    count_miss_timing,
    count_turn,
    summarize,
    summarize_arm,
    summarize_kv_events,
)
from bench.routing_workload import (
    BLOCK_SIZE,
    PRESETS,
    Conversation,
    cache_blocks,
    end_turn,
    live_blocks,
    make_conversations,
    next_prompt,
    num_open,
    preset_args,
)

POLICIES = ("affinity", "round-robin")
# (name, routing policy, routing on KV events) of each gateway, by --compare
ARMS = {"policies": (("affinity", "affinity", True), ("round-robin", "round-robin", True)),
        "kv-events": (("kv-events", "affinity", True), ("index", "affinity", False)),
        "index-twice": (("index", "affinity", False), ("index again", "affinity", False))}


async def _client(stub, open_chats: list[Conversation], waiting: deque[Conversation],
                  rng: random.Random, args: argparse.Namespace, result: PolicyResult,
                  routed: dict[int, tuple[str, int, int]], systems_seen: set[int],
                  live: dict[int, Conversation], live_samples: list[int],
                  answered: Callable[[int], None]) -> None:
    """Runs the next turn of an open conversation picked at random (its user is the next one
    back) and puts it back among the open ones; one that is over makes room for a waiting one."""
    while open_chats:
        conversation = open_chats.pop(rng.randrange(len(open_chats)))
        live[id(conversation)] = conversation
        prompt = next_prompt(conversation, systems_seen)
        response = await stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(token_ids=prompt),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=args.output_len,
                                               ignore_eos=True)), timeout=600)
        result.num_requests += 1
        answered(result.num_requests)
        result.num_prompt_tokens += response.usage.prompt_tokens
        result.num_cached_tokens += response.usage.cached_tokens
        result.num_output_tokens += response.usage.completion_tokens
        replica, num_believed, num_held = routed.pop(hash(tuple(prompt)), ("", 0, 0))
        count_miss_timing(result, conversation, prompt, response.usage.cached_tokens, num_held,
                          num_believed)
        count_turn(result, conversation, prompt, response.usage.cached_tokens, replica)
        if end_turn(conversation, response.outputs[0].token_ids, replica):
            open_chats.append(conversation)
        else:
            del live[id(conversation)]
            if waiting:
                open_chats.append(waiting.popleft())
        if waiting and result.num_requests > num_open(args):
            live_samples.append(live_blocks(list(live.values()), args.num_system_prompts,
                                            args.system_len))


def num_leading(block_hashes: list[BlockHash], holds: Callable[[BlockHash], bool]) -> int:
    """How many of the prompt's leading blocks `holds` holds, up to the first it lacks."""
    return next((i for i, block_hash in enumerate(block_hashes) if not holds(block_hash)),
                len(block_hashes))


def count_decisions(gateway: Gateway, cached_prefix: Callable[[str, list[BlockHash]], int]
                    ) -> tuple[Counter[str], Counter[str], list[list[int]],
                               dict[int, tuple[str, int, int]]]:
    """Counters of the gateway's routing decisions (by reason, by replica), the prompts they
    were made for and, by the prompt's hash, the replica of each with the leading blocks of the
    prompt that the router's KV events said it held and that its prefix cache held
    (`cached_prefix`) at that moment, until `stop_counting`."""
    router = gateway.replicas.router
    choose = router.choose
    reasons: Counter[str] = Counter()
    replicas: Counter[str] = Counter()
    prompts: list[list[int]] = []
    routed: dict[int, tuple[str, int, int]] = {}

    def counted(candidates, prompt_token_ids, block_size):
        decision = choose(candidates, prompt_token_ids, block_size)
        reasons[decision.reason] += 1
        replicas[decision.address] += 1
        prompts.append(list(prompt_token_ids))
        hashes = hash_prompt_blocks(prompt_token_ids, block_size,
                                    (len(prompt_token_ids) - 1) // block_size)
        believed = num_leading(hashes, lambda h: router.kv_index.weight(decision.address, h) > 0)
        routed[hash(tuple(prompt_token_ids))] = (decision.address, believed,
                                                 cached_prefix(decision.address, hashes))
        return decision

    router.choose = counted  # type: ignore[method-assign]
    return reasons, replicas, prompts, routed


def num_preemptions(scheduler) -> int:
    engine = scheduler[1].engine
    return 0 if engine is None else engine.core.scheduler.num_preemptions


def stop_counting(gateway: Gateway) -> None:
    del gateway.replicas.router.choose  # the class's method again


async def run_policy(gateway: Gateway, conversations: list[Conversation], args: argparse.Namespace,
                     policy: str, addresses: list[str],
                     cached_prefix: Callable[[str, list[BlockHash]], int],
                     restart: Callable[[], Awaitable[None]] | None = None) -> PolicyResult:
    """`addresses`: the replicas', r0 first; `cached_prefix`: what a replica's prefix cache
    holds of a prompt's leading blocks now. `restart` runs once --restart-at of the
    conversations' turns are answered, beside them."""
    result = PolicyResult(policy)
    num_turns = sum(len(c.user_turns) for c in conversations)
    restart_after = None if restart is None else int(args.restart_at * num_turns)
    restarts: list[asyncio.Task] = []

    def answered(num_requests: int) -> None:
        if num_requests == restart_after:
            restarts.append(asyncio.create_task(restart()))

    open_chats = conversations[:num_open(args)]
    waiting = deque(conversations[num_open(args):])
    rng = random.Random(args.seed)
    reasons, replicas, prompts, routed = count_decisions(gateway, cached_prefix)
    systems_seen: set[int] = set()
    live: dict[int, Conversation] = {}
    live_samples: list[int] = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        start = time.perf_counter()
        await asyncio.gather(*(_client(stub, open_chats, waiting, rng, args, result, routed,
                                       systems_seen, live, live_samples, answered)
                               for _ in range(args.concurrency)))
        result.elapsed_s = time.perf_counter() - start
        await asyncio.gather(*restarts)
        result.num_restarts = len(restarts)
    result.live_blocks_mean = sum(live_samples) / max(len(live_samples), 1)
    stop_counting(gateway)
    result.decisions = dict(reasons)
    result.replica_share = sorted(replicas.values(), reverse=True)
    result.replica_turns = [replicas[address] for address in addresses]
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
    """Each replica's cache: --kv-cache-memory-gib when given, else --cache-fraction of the
    workload's footprint."""
    return EngineConfig(model=ModelConfig(model=args.model, dtype="float32"),
                        cache=CacheConfig(block_size=BLOCK_SIZE,
                                          kv_cache_memory_gib=args.kv_cache_memory_gib or 1.0,
                                          num_gpu_blocks_override=cache_blocks(args),
                                          swap_space_gib=0.01, enable_prefix_caching=True),
                        scheduler=SchedulerConfig(max_num_seqs=max(args.concurrency, 1)),
                        device=DeviceConfig(device="cpu"))


async def run(args: argparse.Namespace) -> list[PolicyResult]:
    config = engine_config(args)
    replicas = []
    gateways: list[Gateway] = []

    def scheduler_config(port: int, worker) -> SchedulerServiceConfig:
        # a shared CPU host may take long over a step: the run measures hits, not deadlines
        return SchedulerServiceConfig(port=port, worker_addresses=[f"127.0.0.1:{worker[0].port}"],
                                      stats_interval_s=0, step_timeout_s=600)

    async def restart(i: int) -> None:
        """Replica i's scheduler stops at once and a new one takes its port and worker."""
        worker, scheduler = replicas[i]
        port = scheduler[0].port
        await stop_scheduler(*scheduler)
        replicas[i] = (worker, await start_scheduler(config, scheduler_config(port, worker)))

    async def restart_r0() -> None:
        await restart(0)

    def cached_prefix(address: str, block_hashes: list[BlockHash]) -> int:
        engine = replicas[addresses.index(address)][1][1].engine
        if engine is None:
            return 0
        cache = engine.core.block_manager.prefix_cache
        return num_leading(block_hashes, lambda h: cache.lookup(h) is not None)

    try:
        for _ in range(2):
            worker = await start_worker(config, WorkerServiceConfig(port=0))
            replicas.append((worker, await start_scheduler(config, scheduler_config(0, worker))))
        addresses = [f"127.0.0.1:{s[0].port}" for _, s in replicas]
        results = []
        arms = ARMS[args.compare][::-1] if args.reverse else ARMS[args.compare]
        if args.arm:
            arms = tuple(arm for arm in arms if arm[0] == args.arm)
        for i, (name, policy, use_kv_events) in enumerate(arms):
            if i:  # empty caches: the arm before left its blocks
                for r in range(len(replicas)):
                    await restart(r)
            gateway = await start_gateway(GatewayConfig(
                port=0, scheduler_address=",".join(addresses), http=HttpConfig(http_port=-1),
                routing=RoutingConfig(routing_policy=policy,
                                      routing_prefix_blocks=args.routing_prefix_blocks,
                                      routing_kv_events=use_kv_events)))
            gateways.append(gateway)
            while len(gateway.replicas.serving()) < len(replicas):
                await asyncio.sleep(0.05)
            result = await run_policy(gateway, make_conversations(args, 0), args, name, addresses,
                                      cached_prefix,
                                      restart_r0 if args.restart_at is not None else None)
            result.replica_preemptions = [num_preemptions(s) for _, s in replicas]
            results.append(result)
            await gateway.stop(grace_s=0)
            gateways.remove(gateway)
        return results[::-1] if args.reverse else results
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
    parser.add_argument("--quick", action="store_true",
                        help="smaller presets (minutes on a CPU); flags given still win")
    parser.add_argument("--workload", nargs="+", choices=sorted(PRESETS), default=list(PRESETS),
                        help="the presets to run, one after another (default: all)")
    parser.add_argument("--num-system-prompts", type=int,
                        help="the workload flags below override every preset run")
    parser.add_argument("--system-len", type=int)
    parser.add_argument("--num-conversations", type=int)
    parser.add_argument("--num-open", type=int,
                        help="conversations open at once (taken in turn, a turn at a time)")
    parser.add_argument("--num-turns", type=int)
    parser.add_argument("--user-len", type=int, help="a user message's (tool result's) tokens")
    parser.add_argument("--output-len", type=int, help="an answer's (action's) tokens")
    parser.add_argument("--concurrency", type=int)
    parser.add_argument("--cache-fraction", type=float, default=0.6,
                        help="each replica's KV cache, as a fraction of the workload's footprint")
    parser.add_argument("--kv-cache-memory-gib", type=float, default=0.0,
                        help="each replica's KV cache in GiB instead; 0 = by --cache-fraction")
    parser.add_argument("--routing-prefix-blocks", type=int,
                        default=RoutingConfig().routing_prefix_blocks)
    parser.add_argument("--min-token-id", type=int, default=3)
    parser.add_argument("--max-token-id", type=int, default=300)
    parser.add_argument("--compare", choices=sorted(ARMS), default="policies",
                        help="policies: affinity vs round robin; kv-events: affinity on KV events "
                        "vs on the gateway's own index; index-twice: the own index in both arms "
                        "(how far two runs of one routing differ: the timing's draw)")
    parser.add_argument("--restart-at", type=float,
                        help="restart replica r0's scheduler once this fraction of the turns is "
                        "answered, in each run (0 < F < 1)")
    parser.add_argument("--reverse", action="store_true",
                        help="run the compared arms in the other order (the first one runs on "
                        "the process as it started, the second after it)")
    parser.add_argument("--arm", help="run only this arm of --compare (a pair that would "
                        "hold the bench lock too long runs as two records)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    arm_names = [arm[0] for arm in ARMS[args.compare]]
    if args.arm is not None and args.arm not in arm_names:
        parser.error(f"--arm must be one of {arm_names} with --compare {args.compare}, got "
                     f"{args.arm!r}")
    if args.restart_at is not None and not 0 < args.restart_at < 1:
        parser.error(f"--restart-at must be in (0, 1), got {args.restart_at}")
    for preset in args.workload:
        run_args = preset_args(args, preset)
        if num_open(run_args) < run_args.concurrency:
            parser.error(f"--num-open ({num_open(run_args)} with --num-conversations, preset "
                         f"{preset}) must be at least --concurrency ({run_args.concurrency}): a "
                         f"client takes an open conversation")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    quiet_logging()
    logging.getLogger("pagedserve").setLevel(logging.WARNING)
    lines, records = [], []
    summary = (summarize_arm if args.arm else summarize if args.compare == "policies"
               else summarize_kv_events)
    for preset in args.workload:
        run_args = preset_args(args, preset)
        line, record = summary(run_args, *asyncio.run(run(run_args)))
        logging.getLogger("bench.routing").info("%s", line)
        lines.append(line)
        records.append(record)
    targets = ({"hit_token_ratio": 1.8, "throughput_ratio": 1.0, "routing_p50_us": 1000}
               if args.compare == "policies"
               else {"hit_token_ratio": 1.0 if args.restart_at is None else 1.2})
    return finish("routing", args, "\n".join(lines), records, targets=targets)


if __name__ == "__main__":
    main()
