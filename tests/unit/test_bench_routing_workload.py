"""The routing bench's workload: presets and flag overrides, the footprint estimate that sizes the
caches and the measured footprint beside it."""

from __future__ import annotations

import argparse

from bench.routing_workload import (
    PRESETS,
    WORKLOAD_FLAGS,
    footprint_blocks,
    live_blocks,
    make_conversations,
    max_prompt_len,
    preset_args,
    turn_counts,
)


def _args(**given) -> argparse.Namespace:
    values = {name: None for name in WORKLOAD_FLAGS}
    values.update(quick=False, seed=0, min_token_id=3, max_token_id=300)
    values.update(given)
    return argparse.Namespace(**values)


def test_preset_args_take_the_preset_unless_a_flag_was_given():
    agent = preset_args(_args(num_turns=3), "agent")
    assert agent.workload == "agent" and agent.num_turns == 3
    assert agent.user_len == PRESETS["agent"]["user_len"]
    chat = preset_args(_args(), "chat")
    assert {name: getattr(chat, name) for name in WORKLOAD_FLAGS} == PRESETS["chat"]
    assert preset_args(_args(quick=True), "agent").num_conversations < agent.num_conversations


def test_conversations_share_system_prompts_and_the_seed_fixes_them():
    args = preset_args(_args(), "agent")
    conversations = make_conversations(args, salt=0)
    assert len(conversations) == args.num_conversations
    assert len({id(c.system) for c in conversations}) == args.num_system_prompts
    assert all(len(c.user_turns) in turn_counts(args) and len(c.user_turns[0]) == args.user_len
               for c in conversations)
    assert len({len(c.user_turns) for c in conversations}) > 1  # not in step
    again = make_conversations(args, salt=0)
    assert [c.user_turns for c in again] == [c.user_turns for c in conversations]
    other = make_conversations(args, salt=1)  # the other policy's: same shape, other tokens
    assert [len(c.user_turns) for c in other] == [len(c.user_turns) for c in conversations]
    assert other[0].user_turns != conversations[0].user_turns


def test_turn_counts_average_num_turns():
    for num_turns in (1, 2, 3, 6, 10):
        counts = turn_counts(_args(num_turns=num_turns))
        assert min(counts) >= 1 and sum(counts) / len(counts) == num_turns


def test_footprint_counts_systems_once_histories_at_mean_length_and_running_turns():
    args = _args(num_system_prompts=2, system_len=32, num_conversations=8, num_open=4,
                 num_turns=3, user_len=24, output_len=8, concurrency=2)
    # conversations of 2, 3 or 4 turns: an open one has (0+1 + 0+1+2 + 0+1+2+3) / 9 = 10/9 turns
    # done; 2 x 2 system blocks + 4 open x 10/9 turns x 32 tokens / 16 + 2 running x (2 + 1)
    assert footprint_blocks(args) == 4 + round(4 * 10 / 9 * 2) + 6
    # the longest prompt: the system prompt, 4 user messages and the 3 answers between them
    assert max_prompt_len(args) == 32 + 4 * 24 + 3 * 8


def test_live_blocks_counts_each_system_prompt_once():
    args = _args(num_system_prompts=2, system_len=32, num_conversations=3, num_open=3,
                 num_turns=2, user_len=24, output_len=8, concurrency=1)
    conversations = make_conversations(args, salt=0)
    for conversation in conversations[:2]:
        conversation.history = conversation.system + conversation.user_turns[0] + [7] * 9
    # 2 system prompts x 2 blocks; each history 32 + 33 tokens: 5 blocks, 3 beyond its system
    assert live_blocks(conversations[:2], 2, 32) == 4 + 2 * 3
    assert live_blocks([], 2, 32) == 4
    assert max(PRESETS["agent"]["system_len"] + 1, max_prompt_len(
        preset_args(_args(), "agent"))) <= 8192  # SmolLM2's max_model_len
