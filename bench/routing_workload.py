"""The routing bench's workloads: conversations that share system prompts and grow a turn at a
time, the named presets (`chat`, `agent`) and the KV-cache footprint that sizes the replicas'
caches."""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

BLOCK_SIZE = 16
WORKLOAD_FLAGS = ("num_system_prompts", "system_len", "num_conversations", "num_open",
                  "num_turns", "user_len", "output_len", "concurrency")
# the flags' values per preset, full and --quick (see bench/routing.py for why these)
PRESETS = {
    "chat": dict(num_system_prompts=12, system_len=128, num_conversations=32, num_open=16,
                 num_turns=6, user_len=64, output_len=32, concurrency=8),
    "agent": dict(num_system_prompts=4, system_len=128, num_conversations=20, num_open=10,
                  num_turns=10, user_len=256, output_len=16, concurrency=8),
}
QUICK_PRESETS = {
    "chat": dict(num_system_prompts=4, system_len=96, num_conversations=8, num_open=6,
                 num_turns=3, user_len=64, output_len=8, concurrency=4),
    "agent": dict(num_system_prompts=2, system_len=96, num_conversations=6, num_open=4,
                  num_turns=4, user_len=128, output_len=8, concurrency=4),
}


@dataclass(slots=True)
class Conversation:
    system: list[int]
    user_turns: list[list[int]]  # token ids of each user message (or tool result)
    history: list[int] = field(default_factory=list)  # the prompt so far, answers included
    num_turns_done: int = 0
    num_computed: int = 0  # tokens of `history` whose KV a replica computed (the last one's not)
    replica: str = ""  # the replica of its last turn


def next_prompt(conversation: Conversation, systems_seen: set[int]) -> list[int]:
    """The conversation's next turn: its history and a new user message. A first turn's system
    prompt counts as computed once a conversation of it ran before (`systems_seen`)."""
    if not conversation.history:
        conversation.history = list(conversation.system)
        if id(conversation.system) in systems_seen:
            conversation.num_computed = len(conversation.system)
        systems_seen.add(id(conversation.system))
    conversation.history += conversation.user_turns[conversation.num_turns_done]
    return list(conversation.history)


def end_turn(conversation: Conversation, answer: Sequence[int], replica: str) -> bool:
    """The turn's answer joins the history; whether the conversation has another turn."""
    conversation.replica = replica
    conversation.history += answer
    conversation.num_computed = len(conversation.history) - 1
    conversation.num_turns_done += 1
    return conversation.num_turns_done < len(conversation.user_turns)


def preset_args(args: argparse.Namespace, preset: str) -> argparse.Namespace:
    """`args` with the preset's workload flags, except those given on the command line."""
    values = (QUICK_PRESETS if args.quick else PRESETS)[preset]
    out = argparse.Namespace(**vars(args))
    out.workload = preset
    for name in WORKLOAD_FLAGS:
        if getattr(args, name) is None:
            setattr(out, name, values[name])
    return out


def turn_counts(args: argparse.Namespace) -> range:
    """A conversation's number of turns, drawn uniformly from this range: `num_turns` on average.
    Equal lengths would keep the conversations that start together in step, so that the open ones
    all grow and end at once instead of being at all depths."""
    low = max(1, (args.num_turns + 1) // 2)
    return range(low, 2 * args.num_turns - low + 1)


def make_conversations(args: argparse.Namespace, salt: int) -> list[Conversation]:
    """Every salt draws its own tokens into the same shape (turns per conversation, order)."""
    shape_rng = random.Random(args.seed)
    rng = random.Random(1000 * args.seed + salt)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(n)]

    systems = [tokens(args.system_len) for _ in range(args.num_system_prompts)]
    counts = turn_counts(args)
    return [Conversation(systems[i % len(systems)],
                         [tokens(args.user_len) for _ in range(shape_rng.choice(counts))])
            for i in range(args.num_conversations)]


def num_open(args: argparse.Namespace) -> int:
    return min(args.num_open, args.num_conversations)


def footprint_blocks(args: argparse.Namespace, block_size: int = BLOCK_SIZE) -> int:
    """The KV blocks it takes to cache every system prompt and the open conversations' histories
    at their mean length between turns, plus what the running turns add to theirs (a user
    message, an answer, a partial block each). A conversation of T turns is open for T turns
    with k = 0 .. T - 1 turns done, so the open ones are the long ones more often: E[T (T - 1) / 2]
    / E[T] turns of a user message and an answer on average."""
    counts = turn_counts(args)
    mean_turns_done = sum(t * (t - 1) / 2 for t in counts) / sum(counts)
    mean_history = mean_turns_done * (args.user_len + args.output_len)
    running = args.concurrency * (math.ceil((args.user_len + args.output_len) / block_size) + 1)
    return (args.num_system_prompts * (args.system_len // block_size)
            + round(num_open(args) * mean_history / block_size) + running)


def cache_blocks(args: argparse.Namespace) -> int:
    """Each replica's KV blocks: --cache-fraction of the footprint (0: by --kv-cache-memory-gib)."""
    return 0 if args.kv_cache_memory_gib else math.ceil(args.cache_fraction
                                                        * footprint_blocks(args))


def live_blocks(conversations: list[Conversation], num_system_prompts: int, system_len: int,
                block_size: int = BLOCK_SIZE) -> int:
    """The KV blocks the started, unfinished conversations' histories take now, each system
    prompt counted once: what footprint_blocks estimates, measured."""
    own = sum(math.ceil(len(c.history) / block_size) - len(c.system) // block_size
              for c in conversations)
    return num_system_prompts * (system_len // block_size) + own


def max_prompt_len(args: argparse.Namespace) -> int:
    """The longest prompt of the workload: the longest conversation's last turn."""
    num_turns = turn_counts(args)[-1]
    return args.system_len + num_turns * args.user_len + (num_turns - 1) * args.output_len
