"""The routing bench's results: one policy's counts and a preset's affinity / round robin line
and record."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from bench.routing_workload import (
    BLOCK_SIZE,
    WORKLOAD_FLAGS,
    Conversation,
    cache_blocks,
    footprint_blocks,
    max_prompt_len,
)

ARM_LABELS = {"kv-events": "KV events", "index": "own index"}


@dataclass(slots=True)
class PolicyResult:
    policy: str
    num_requests: int = 0
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    elapsed_s: float = 0.0
    routing_us: dict[str, float] = field(default_factory=dict)
    decisions: dict[str, int] = field(default_factory=dict)  # by reason
    replica_share: list[int] = field(default_factory=list)  # decisions per replica
    # per replica, r0 first: its turns, and its preemptions since its scheduler last started
    replica_turns: list[int] = field(default_factory=list)
    replica_preemptions: list[int] = field(default_factory=list)
    # prompt tokens some replica had computed before (whole blocks): what a cache could serve
    num_reusable_tokens: int = 0
    num_shared_reusable_tokens: int = 0  # of them, in the system prompts
    # reusable tokens not served, by the turn's kind: a chat's first turn (its system prompt), a
    # later turn on its previous turn's replica (evicted there), or on another replica (moved)
    missed_tokens: dict[str, int] = field(default_factory=dict)
    # the blocks the open conversations' histories took, mean over the turns after the first
    # `num_open` while conversations still wait (the steady state): footprint_blocks, measured
    live_blocks_mean: float = 0.0
    num_restarts: int = 0  # of replica r0 during the run
    # the later turns' missed reusable tokens by when the chosen replica lost them: already gone
    # when the turn was routed, or between its routing and its admission
    missed_when: dict[str, int] = field(default_factory=dict)
    # the leading prompt blocks the router's KV events said the chosen replica held, beyond
    # ("over") or short of ("under") what its prefix cache held as the turn was routed
    belief_error_blocks: dict[str, int] = field(default_factory=dict)

    @property
    def output_tok_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s if self.elapsed_s else 0.0

    @property
    def hit_share(self) -> float:
        """Of the reusable prompt tokens, those served from a cache."""
        return self.num_cached_tokens / max(self.num_reusable_tokens, 1)

    @property
    def ratio_when_moves_miss(self) -> float:
        """Affinity's hit tokens over round robin's when affinity hits every reusable token and
        round robin those of the turns on their previous turn's replica (half) and only the
        system prompts of the others: 2 / (1 + s), s = the system prompts' share."""
        shared = self.num_shared_reusable_tokens / max(self.num_reusable_tokens, 1)
        return 2 / (1 + shared)


def count_turn(result: PolicyResult, conversation: Conversation, prompt: list[int],
               num_cached_tokens: int, replica: str) -> None:
    """A turn's reusable tokens and what it missed of them, by kind (before end_turn)."""
    # a hit stops a block short of the whole prompt: the last token's logits are needed
    reusable = min(conversation.num_computed, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    kind = ("first" if not conversation.num_turns_done else
            "same_replica" if replica == conversation.replica else "moved")
    result.num_reusable_tokens += reusable
    result.num_shared_reusable_tokens += min(
        reusable, len(conversation.system) // BLOCK_SIZE * BLOCK_SIZE)
    result.missed_tokens[kind] = (result.missed_tokens.get(kind, 0)
                                  + max(reusable - num_cached_tokens, 0))


def count_miss_timing(result: PolicyResult, conversation: Conversation, prompt: list[int],
                      num_cached_tokens: int, num_held_blocks: int,
                      num_believed_blocks: int) -> None:
    """A later turn's missed reusable tokens split by when they left the chosen replica's cache
    (it held `num_held_blocks` of the prompt's leading blocks when the turn was routed), and how
    far the KV events' view of it (`num_believed_blocks`) was off then (before end_turn)."""
    if not conversation.num_turns_done:
        return
    reusable = min(conversation.num_computed, len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    held = min(num_held_blocks * BLOCK_SIZE, reusable)
    for when, num_missed in (("before_routing", reusable - held),
                             ("after_routing", held - num_cached_tokens)):
        result.missed_when[when] = result.missed_when.get(when, 0) + max(num_missed, 0)
    error = num_believed_blocks - num_held_blocks
    if error:
        side = "over" if error > 0 else "under"
        result.belief_error_blocks[side] = result.belief_error_blocks.get(side, 0) + abs(error)


def record_head(args: argparse.Namespace) -> dict:
    """What every preset's record starts with: the workload and the caches it ran on."""
    return {"workload": args.workload,
            "workload_args": {name: getattr(args, name) for name in WORKLOAD_FLAGS},
            "cache_blocks": cache_blocks(args)}


def summarize(args: argparse.Namespace, affinity: PolicyResult,
              round_robin: PolicyResult) -> tuple[str, dict]:
    """One preset's result line and record: affinity over round robin, and the ratio when round
    robin's moved turns miss."""
    hit_ratio = affinity.num_cached_tokens / max(round_robin.num_cached_tokens, 1)
    throughput_ratio = affinity.output_tok_s / max(round_robin.output_tok_s, 1e-9)
    line = (f"routing {args.workload}: affinity {affinity.num_cached_tokens} hit tokens, "
            f"{affinity.output_tok_s:.1f} tok/s; round-robin {round_robin.num_cached_tokens} "
            f"hit tokens, {round_robin.output_tok_s:.1f} tok/s; hit tokens x{hit_ratio:.2f} "
            f"(target >= 1.8), throughput x{throughput_ratio:.2f} (target >= 1.0), routing "
            f"p50 {affinity.routing_us['p50']:.1f} us (target <= 1000); affinity decisions "
            f"{affinity.decisions}, per replica {affinity.replica_share}; of the reusable prompt "
            f"tokens ({round_robin.num_reusable_tokens}, "
            f"{round_robin.num_shared_reusable_tokens} in system prompts) affinity hit "
            f"{affinity.hit_share:.0%}, round robin {round_robin.hit_share:.0%} (x"
            f"{round_robin.ratio_when_moves_miss:.2f} when moves miss); missed by kind of turn: "
            f"affinity {affinity.missed_tokens}, round robin {round_robin.missed_tokens}; "
            f"footprint {footprint_blocks(args)} blocks estimated, "
            f"{round_robin.live_blocks_mean:.0f} measured, cache {cache_blocks(args)} blocks per "
            f"replica")
    record = {**record_head(args), "max_prompt_len": max_prompt_len(args),
              "footprint_blocks": footprint_blocks(args), "hit_token_ratio": hit_ratio,
              "throughput_ratio": throughput_ratio,
              "ratio_when_moves_miss": round_robin.ratio_when_moves_miss,
              "summary": line, "policies": [affinity, round_robin]}
    return line, record


def summarize_kv_events(args: argparse.Namespace, events: PolicyResult,
                        index: PolicyResult) -> tuple[str, dict]:
    """One preset's line and record: affinity on KV events over affinity on the own index (or,
    `--compare index-twice`, the first run of the own index over the second)."""
    hit_ratio = events.num_cached_tokens / max(index.num_cached_tokens, 1)
    restart = ("" if args.restart_at is None
               else f", replica r0 restarted once {args.restart_at:.0%} of the turns were answered")
    target = 1.0 if args.restart_at is None else 1.2
    first, second = (ARM_LABELS.get(r.policy, r.policy) for r in (events, index))
    line = (f"routing {args.workload}{restart}: {first} {events.num_cached_tokens} hit tokens "
            f"({events.hit_share:.0%} of the reusable), {events.output_tok_s:.1f} tok/s; {second} "
            f"{index.num_cached_tokens} ({index.hit_share:.0%}), {index.output_tok_s:.1f} tok/s; "
            f"hit tokens x{hit_ratio:.2f} (target >= {target}); decisions: {first} "
            f"{events.decisions}, {second} {index.decisions}; missed by kind of turn: {first} "
            f"{events.missed_tokens}, {second} {index.missed_tokens}; turns per replica (r0, r1): "
            f"{first} {events.replica_turns}, {second} {index.replica_turns}; preemptions: "
            f"{first} {events.replica_preemptions}, {second} {index.replica_preemptions}; "
            f"missed when: {first} {events.missed_when}, {second} {index.missed_when}; KV events "
            f"off the caches by (blocks): {first} {events.belief_error_blocks}, {second} "
            f"{index.belief_error_blocks}; cache {cache_blocks(args)} blocks per replica")
    record = {**record_head(args), "restart_at": args.restart_at, "hit_token_ratio": hit_ratio,
              "summary": line, "policies": [events, index]}
    return line, record


def summarize_arm(args: argparse.Namespace, result: PolicyResult) -> tuple[str, dict]:
    """One arm run alone (`--arm`): its line and record, for a ratio over another record."""
    label = ARM_LABELS.get(result.policy, result.policy)
    line = (f"routing {args.workload}, {label} alone: {result.num_cached_tokens} hit tokens "
            f"({result.hit_share:.0%} of the reusable), {result.output_tok_s:.1f} tok/s; "
            f"decisions {result.decisions}; missed by kind of turn {result.missed_tokens}; turns "
            f"per replica (r0, r1) {result.replica_turns}; preemptions "
            f"{result.replica_preemptions}; missed when {result.missed_when}; KV events off "
            f"the caches by (blocks) {result.belief_error_blocks}; cache {cache_blocks(args)} "
            f"blocks per replica")
    return line, {**record_head(args), "restart_at": args.restart_at, "summary": line,
                  "policies": [result]}
