"""Routing replayed offline: bench.routing's workload through the gateway's Router, with each
replica's prefix cache modelled, over many seeds in seconds.

bench.routing measures one seed on real replicas in minutes, and a seed's ratio swings by tenths
(which conversations grow long on which replica is chance): too few to tell a routing change from
luck. The replay runs the same conversations, turn picks and accounting (bench.routing_workload,
count_turn) through the real Router, and models what decides hits: each replica's KV cache as the
scheduler keeps it (a prompt hits its longest cached prefix, a block short of the whole prompt; a
finished turn's full blocks of computed KV stay cached, released last to first into an LRU evictor, reclaimed
when a turn needs room) and the order turns finish in (`--concurrency` clients; a replica shares
its time among its running turns, a turn costing its uncached prompt tokens and DECODE_COST per
output token). Not modelled: waiting for free blocks, preemption, the gateway's load lag.

Per preset: affinity's and round robin's mean share of the reusable tokens, the mean and worst
ratio of their hit tokens, and `pooled`: one replica with both caches (round robin over it), what
affinity would hit if where a conversation runs did not matter.

    python -m bench.routing_replay --workload agent --seeds 40
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
from collections import OrderedDict
from collections.abc import Callable

from pagedserve.services.common.block_hash import hash_prompt_blocks
from pagedserve.services.common.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    KVEventBatch,
)
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.gateway.routing import Candidate, Router

from bench.common import finish
from bench.routing_report import PolicyResult, count_turn
from bench.routing_workload import (
    BLOCK_SIZE,
    PRESETS,
    WORKLOAD_FLAGS,
    cache_blocks,
    end_turn,
    make_conversations,
    next_prompt,
    num_open,
    preset_args,
)

DECODE_COST = 20.0  # an output token's time in prompt tokens' (a decode step is batched)
RESTART_TURNS = 2  # turns that start while a restarted replica is down (its new scheduler starts)


class CacheModel:
    """One replica's KV blocks by prefix hash: those of running turns (referenced), cached ones no
    turn holds (LRU), and running turns' blocks not yet full or not yet named. `on_event` gets
    the KV events a scheduler would publish (blocks named, evicted, all dropped by a restart)."""

    def __init__(self, num_blocks: int,
                 on_event: Callable[[KVEvent], None] | None = None) -> None:
        self.num_blocks = num_blocks
        self._refs: dict[bytes, int] = {}
        self._evictor: OrderedDict[bytes, None] = OrderedDict()
        self._num_unnamed = 0
        self._on_event = on_event or (lambda event: None)

    def admit(self, hashes: list[bytes], num_blocks: int, max_hit_blocks: int) -> int:
        """A turn of `num_blocks` (prompt and answer) starts: its cached blocks. The prompt's
        other full blocks (`hashes`) are named as its prefill computes them, as the scheduler
        names a block once computed; the rest are taken unnamed."""
        num_hit = 0
        for block_hash in hashes[:max_hit_blocks]:
            if block_hash not in self._refs and block_hash not in self._evictor:
                break
            num_hit += 1
        for block_hash in hashes[:num_hit]:
            self._hold(block_hash)
        self._num_unnamed += num_blocks - num_hit
        self._make_room()
        self._name(hashes, num_hit)
        self._num_unnamed -= len(hashes) - num_hit
        return num_hit

    def finish(self, hashes: list[bytes], num_named: int, num_blocks: int) -> None:
        """The turn ends: its full blocks (`hashes`, prompt and answer, the first `num_named`
        named at its start) stay cached."""
        self._num_unnamed -= num_blocks - num_named
        self._name(hashes, num_named)
        for block_hash in reversed(hashes):
            self._refs[block_hash] -= 1
            if not self._refs[block_hash]:
                del self._refs[block_hash]
                self._evictor[block_hash] = None
        self._make_room()

    def _name(self, hashes: list[bytes], first: int) -> None:
        """The turn holds hashes[first:] from now; those new to the cache are stored."""
        new = [h for h in hashes[first:] if h not in self._refs and h not in self._evictor]
        for block_hash in hashes[first:]:
            self._hold(block_hash)
        if new:
            start = hashes.index(new[0])
            self._on_event(BlockStored(tuple(new), hashes[start - 1] if start else None,
                                       BLOCK_SIZE))

    def clear(self) -> None:
        """The snapshot of an empty cache (a new scheduler's, under a new log)."""
        assert not self._refs and not self._evictor, "clear a cache no turn used"
        self._on_event(AllBlocksCleared())

    def _hold(self, block_hash: bytes) -> None:
        self._evictor.pop(block_hash, 0)
        self._refs[block_hash] = self._refs.get(block_hash, 0) + 1

    def _make_room(self) -> None:
        while self._evictor and (len(self._refs) + len(self._evictor) + self._num_unnamed
                                 > self.num_blocks):
            self._on_event(BlockRemoved((self._evictor.popitem(last=False)[0],)))


def replay(policy: str, args: argparse.Namespace, salt: int, num_replicas: int = 2,
           cache_scale: int = 1, use_kv_events: bool = False,
           restart_at: float | None = None, num_gateways: int = 1) -> PolicyResult:
    """`use_kv_events`: affinity on what the replicas report holding; `restart_at`: after this
    fraction of the turns started, replica r0 restarts as in bench.routing: its cache is lost,
    the turns it ran fail over (routed again among the others, computed there from what they
    hold), and it takes no turn and streams no events for the next RESTART_TURNS turns;
    `num_gateways`: each turn reaches one of them at random (each knows only what it routed,
    and every one gets the events)."""
    result = PolicyResult(policy)
    conversations = make_conversations(args, salt)
    open_chats, waiting = conversations[:num_open(args)], conversations[num_open(args):]
    rng = random.Random(args.seed)
    num_blocks = cache_scale * cache_blocks(args)
    routers = [Router(policy, args.routing_max_imbalance, args.routing_prefix_blocks,
                      use_kv_events=use_kv_events) for _ in range(num_gateways)]
    gateway_rng = random.Random(args.seed + 1)
    sequences = itertools.count(1)

    def publisher(address: str) -> Callable[[KVEvent], None]:
        def publish(event: KVEvent) -> None:
            batch = KVEventBatch(f"{address}-{num_restarts if address == 'r0' else 0}",
                                 next(sequences), (event,),
                                 is_snapshot=isinstance(event, AllBlocksCleared))
            for router in routers:
                router.kv_index.apply(address, batch)
        return publish

    num_restarts = 0
    caches = {f"r{i}": CacheModel(num_blocks, publisher(f"r{i}")) for i in range(num_replicas)}
    for cache in caches.values():
        cache.clear()  # the empty snapshot a gateway starts from
    down_until = -1  # r0 is down while turns before this one start
    work: dict[str, dict[int, float]] = {address: {} for address in caches}
    num_turns = sum(len(c.user_turns) for c in conversations)
    restart_turn = None if restart_at is None else int(restart_at * num_turns)
    turns: dict[int, tuple] = {}
    systems_seen: set[int] = set()

    def route(turn_id: int, conversation, prompt: list[int], router: Router) -> int:
        """The turn runs on the replica the router picks: its hit tokens."""
        serving = [a for a in caches if a != "r0" or turn_id >= down_until]
        decision = router.choose([Candidate(a, len(work[a]), num_blocks) for a in serving],
                                 prompt, BLOCK_SIZE)
        result.decisions[decision.reason] = result.decisions.get(decision.reason, 0) + 1
        hashes = hash_prompt_blocks(prompt, BLOCK_SIZE, len(prompt) // BLOCK_SIZE)
        turn_blocks = math.ceil((len(prompt) + args.output_len) / BLOCK_SIZE)
        num_hit = caches[decision.address].admit(hashes, turn_blocks,
                                                 (len(prompt) - 1) // BLOCK_SIZE)
        work[decision.address][turn_id] = (len(prompt) - num_hit * BLOCK_SIZE
                                           + DECODE_COST * args.output_len)
        turns[turn_id] = (conversation, decision.address, prompt, num_hit, turn_blocks, router)
        return num_hit * BLOCK_SIZE

    def start_turn(turn_id: int) -> None:
        conversation = open_chats.pop(rng.randrange(len(open_chats)))
        prompt = next_prompt(conversation, systems_seen)
        num_hit_tokens = route(turn_id, conversation, prompt,
                               routers[gateway_rng.randrange(num_gateways)])
        result.num_requests += 1
        result.num_cached_tokens += num_hit_tokens
        count_turn(result, conversation, prompt, num_hit_tokens, turns[turn_id][1])

    def restart_r0(next_turn: int) -> None:
        """What r0 held and ran is lost; its running turns fail over, counted as they end
        (a client sees the hit tokens of the replica that answered)."""
        nonlocal num_restarts, down_until
        num_restarts += 1
        down_until = next_turn + RESTART_TURNS
        for router in routers:
            router.kv_index.mark_lost("r0")
        failed = list(work["r0"])
        work["r0"].clear()
        caches["r0"] = CacheModel(num_blocks, publisher("r0"))
        for turn_id in failed:
            conversation, _, prompt, num_hit, _, router = turns.pop(turn_id)
            result.num_cached_tokens += route(turn_id, conversation, prompt, router) - (
                num_hit * BLOCK_SIZE)

    for turn_id in range(min(args.concurrency, len(open_chats))):
        start_turn(turn_id)
    next_id = len(turns)
    while turns:
        _, address, done = min((w * len(work[a]), a, t) for a, running in work.items()
                               for t, w in running.items())
        elapsed = work[address][done] * len(work[address])
        for running in work.values():
            for turn_id in running:
                running[turn_id] -= elapsed / len(running)
        del work[address][done]
        conversation, address, prompt, num_hit, turn_blocks, _ = turns.pop(done)
        answer = [rng.randrange(args.min_token_id, args.max_token_id)
                  for _ in range(args.output_len)]
        # the last answer token was sampled, never fed back: no KV
        full = (prompt + answer)[:-1]
        caches[address].finish(hash_prompt_blocks(full, BLOCK_SIZE, len(full) // BLOCK_SIZE),
                               len(prompt) // BLOCK_SIZE, turn_blocks)
        if end_turn(conversation, answer, address):
            open_chats.append(conversation)
        elif waiting:
            open_chats.append(waiting.pop(0))
        if next_id == restart_turn:
            restart_r0(next_id)
        if next_id == down_until:
            caches["r0"].clear()  # serving again, under a new log
        if open_chats:
            start_turn(next_id)
            next_id += 1
    return result


def compare(args: argparse.Namespace, num_seeds: int) -> str:
    """One preset over seeds 0 .. num_seeds - 1: the line of means."""
    shares: dict[str, list[float]] = {"affinity": [], "round-robin": [], "pooled": []}
    ratios = []
    for seed in range(num_seeds):
        run_args = argparse.Namespace(**{**vars(args), "seed": seed})
        affinity = replay("affinity", run_args, 0)
        round_robin = replay("round-robin", run_args, 1)
        pooled = replay("round-robin", run_args, 0, num_replicas=1, cache_scale=2)
        for name, result in zip(shares, (affinity, round_robin, pooled), strict=True):
            shares[name].append(result.hit_share)
        ratios.append(affinity.num_cached_tokens / max(round_robin.num_cached_tokens, 1))
    means = ", ".join(f"{name} {statistics.mean(values):.1%}" for name, values in shares.items())
    return (f"replay {args.workload} ({num_seeds} seeds, cache {cache_blocks(args)} blocks per "
            f"replica): mean share of the reusable tokens hit: {means}; hit tokens affinity / "
            f"round robin: mean x{statistics.mean(ratios):.2f}, worst x{min(ratios):.2f}, "
            f"seed 0 x{ratios[0]:.2f}")


def compare_kv_events(args: argparse.Namespace, num_seeds: int) -> tuple[str, dict]:
    """Affinity on KV events against affinity on the gateway's own index, over seeds: as is, with
    replica r0 restarted halfway, and behind two gateways: the line and the numbers."""
    cases = (("steady", None, 1), ("restart", 0.5, 1), ("two_gateways", None, 2))
    ratios: dict[str, list[float]] = {kind: [] for kind, _, _ in cases}
    hits: dict[str, list[int]] = {f"{kind}_{source}": [] for kind in ratios
                                  for source in ("index", "events")}
    for seed in range(num_seeds):
        run_args = argparse.Namespace(**{**vars(args), "seed": seed})
        for kind, restart_at, num_gateways in cases:
            index = replay("affinity", run_args, 0, restart_at=restart_at,
                           num_gateways=num_gateways)
            events = replay("affinity", run_args, 0, use_kv_events=True, restart_at=restart_at,
                            num_gateways=num_gateways)
            hits[f"{kind}_index"].append(index.num_cached_tokens)
            hits[f"{kind}_events"].append(events.num_cached_tokens)
            ratios[kind].append(events.num_cached_tokens / max(index.num_cached_tokens, 1))
    line = (f"replay {args.workload} ({num_seeds} seeds, cache {cache_blocks(args)} blocks per "
            f"replica): hit tokens KV events / own index: " + "; ".join(
                f"{kind} mean x{statistics.mean(r):.2f}, worst x{min(r):.2f} "
                f"({statistics.mean(hits[kind + '_events']):.0f} vs "
                f"{statistics.mean(hits[kind + '_index']):.0f} tokens)"
                for kind, r in ratios.items()))
    return line, {"workload": args.workload, "cache_blocks": cache_blocks(args),
                  "ratios": ratios, "hit_tokens": hits}


def main(argv: list[str] | None = None) -> list[str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", nargs="+", choices=sorted(PRESETS), default=list(PRESETS))
    parser.add_argument("--seeds", type=int, default=20, help="seeds 0 .. N-1, each a run")
    parser.add_argument("--quick", action="store_true", help="bench.routing's smaller presets")
    parser.add_argument("--cache-fraction", type=float, default=0.6,
                        help="each replica's KV cache, as a fraction of the workload's footprint")
    parser.add_argument("--routing-prefix-blocks", type=int,
                        default=RoutingConfig().routing_prefix_blocks)
    parser.add_argument("--routing-max-imbalance", type=float,
                        default=RoutingConfig().routing_max_imbalance)
    parser.add_argument("--kv-events", action="store_true",
                        help="compare affinity on KV events with affinity on the gateway's own "
                        "index, steady and with one replica restarted halfway (recorded)")
    parser.add_argument("--tag", default="", help="suffix of the record's file name")
    args = parser.parse_args(argv)
    base = argparse.Namespace(**vars(args), seed=0, kv_cache_memory_gib=0.0, min_token_id=3,
                              max_token_id=300, **dict.fromkeys(WORKLOAD_FLAGS))
    if args.kv_events:
        compared = [compare_kv_events(preset_args(base, preset), args.seeds)
                    for preset in args.workload]
        lines = [line for line, _ in compared]
        finish("routing_replay", args, "\n".join(lines), [result for _, result in compared],
               targets={"steady": 1.0, "restart": 1.2})
        return lines
    lines = [compare(preset_args(base, preset), args.seeds) for preset in args.workload]
    print("\n".join(lines), flush=True)
    return lines


if __name__ == "__main__":
    main()
