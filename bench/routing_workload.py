"""The routing bench's workloads: conversations that share system prompts and grow a turn at a
time, the named presets (`chat`, `agent`) and the KV-cache footprint that sizes the replicas'
caches."""

from __future__ import annotations

import argparse
import math
import random
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


def preset_args(args: argparse.Namespace, preset: str) -> argparse.Namespace:
    """`args` with the preset's workload flags, except those given on the command line."""
    values = (QUICK_PRESETS if args.quick else PRESETS)[preset]
    out = argparse.Namespace(**vars(args))
    out.workload = preset
    for name in WORKLOAD_FLAGS:
        if getattr(args, name) is None:
            setattr(out, name, values[name])
    return out


def make_conversations(args: argparse.Namespace, salt: int) -> list[Conversation]:
    rng = random.Random(1000 * args.seed + salt)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(args.min_token_id, args.max_token_id) for _ in range(n)]

    systems = [tokens(args.system_len) for _ in range(args.num_system_prompts)]
    return [Conversation(systems[i % len(systems)],
                         [tokens(args.user_len) for _ in range(args.num_turns)])
            for i in range(args.num_conversations)]


def num_open(args: argparse.Namespace) -> int:
    return min(args.num_open, args.num_conversations)


def footprint_blocks(args: argparse.Namespace, block_size: int = BLOCK_SIZE) -> int:
    """The KV blocks it takes to cache every system prompt and the open conversations' histories
    at their mean length between turns (k turns done, k = 0 .. num_turns - 1: (num_turns - 1) / 2
    turns of a user message and an answer), plus what the running turns add to theirs (a user
    message, an answer, a partial block each)."""
    mean_history = (args.num_turns - 1) / 2 * (args.user_len + args.output_len)
    running = args.concurrency * (math.ceil((args.user_len + args.output_len) / block_size) + 1)
    return (args.num_system_prompts * (args.system_len // block_size)
            + round(num_open(args) * mean_history / block_size) + running)


def live_blocks(conversations: list[Conversation], num_system_prompts: int, system_len: int,
                block_size: int = BLOCK_SIZE) -> int:
    """The KV blocks the started, unfinished conversations' histories take now, each system
    prompt counted once: what footprint_blocks estimates, measured."""
    own = sum(math.ceil(len(c.history) / block_size) - len(c.system) // block_size
              for c in conversations)
    return num_system_prompts * (system_len // block_size) + own


def max_prompt_len(args: argparse.Namespace) -> int:
    """The longest prompt of the workload: a conversation's last turn."""
    return args.system_len + args.num_turns * args.user_len + (args.num_turns - 1) * args.output_len
