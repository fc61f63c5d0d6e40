"""The draft model's deferred catch-up: a prompt costs it nothing until its sequence proposes, a
sequence whose draft KV lags is caught up in bounded chunks and not drafted until it is, and the
blocks that hold the draft's KV keep it through prefix-cache hits, swaps and recomputes."""

from __future__ import annotations

from pagedserve.services.common.step_plan import (
    NewSequence,
    RunningSequence,
    SampledSequence,
    StepPlan,
)
from pagedserve.worker_svc.draft_blocks import DraftBlocks

from tests.unit.test_draft_proposer import Harness, new_seq

PROMPT = [10 + t for t in range(20)]
TABLE = list(range(1, 16))  # block size 4: position p at slot 4 + p
TARGET = list(range(40, 80))  # the target's tokens after the prompt: the stand-in drafts them


def prompt_then_decodes(max_catch_up_tokens: int, slots: list[int]
                        ) -> tuple[Harness, dict[int, list[int]], list[tuple[int, int, int]]]:
    """A 20-token prompt computed while speculation is off, then decode steps of these many
    lookahead slots. Returns the drafts by the number of known tokens they follow, and every
    draft forward's (token, position, slot)."""
    h = Harness()
    h.proposer.max_catch_up_tokens = max_catch_up_tokens
    calls, _ = h.step(new=[new_seq(token_ids=PROMPT, prompt_len=20, block_ids=TABLE,
                                   num_scheduled_tokens=20)], sampled=TARGET[:1])
    assert calls == []
    drafts_after, all_calls = {}, []
    for num_slots in slots:
        seq = h.mirrors.seqs[1]
        num_known = len(seq.token_ids)
        calls, drafts = h.step(running=[RunningSequence(
            1, [], len(TABLE), [], num_scheduled_tokens=1 + num_slots,
            num_lookahead_slots=num_slots)])
        all_calls += [c for forward in calls for c in forward]
        if drafts:
            drafts_after[num_known] = drafts
        elif num_slots:  # too far behind: no draft, the one next token
            assert h.behind == {1} and num_known - seq.num_draft_computed > 0
        num_kept = next((j for j, d in enumerate(drafts) if d != TARGET[num_known - 20 + j]),
                        len(drafts))
        h.mirrors.append_drawn([seq], [SampledSequence(1, TARGET[
            num_known - 20:num_known - 19 + num_kept], [0.0] * (1 + num_kept))])
    return h, drafts_after, all_calls


def test_a_prompt_waits_and_a_lagging_sequence_catches_up_in_chunks_without_drafting():
    h, drafts, calls = prompt_then_decodes(max_catch_up_tokens=8, slots=[2, 2, 2, 2])
    # behind for two steps (8 tokens caught up in each), then drafting, each draft kept
    assert drafts == {23: [43, 44], 26: [46, 47]}
    assert [p for _, p, _ in calls[:16]] == list(range(16))
    seq = h.mirrors.seqs[1]
    assert seq.token_ids[20:] == TARGET[:9]


def test_drafts_after_a_chunked_catch_up_are_those_of_an_eager_one():
    """The same drafts after the same tokens as a draft model that caught up at once, and each
    known token's draft KV computed once, at its position and slot."""
    _, chunked, chunked_calls = prompt_then_decodes(max_catch_up_tokens=8, slots=[2] * 5)
    _, eager, eager_calls = prompt_then_decodes(max_catch_up_tokens=1000, slots=[0, 0, 2, 2, 2])
    assert chunked == eager and len(chunked) == 3
    tokens = PROMPT + TARGET
    for calls in (chunked_calls, eager_calls):
        positions = sorted(p for _, p, _ in calls)
        assert positions == list(range(len(positions)))
        assert all(t == tokens[p] and slot == 4 + p for t, p, slot in calls)


def plan(step_id: int, new=(), running=(), **ops) -> StepPlan:
    return StepPlan(scheduler_epoch=1, step_id=step_id, new_seqs=list(new),
                    running_seqs=list(running), previous_step_id=step_id - 1, **ops)


def whole(seq_id: int, block_ids: list[int], num_computed: int, num_lookahead_slots: int = 2
          ) -> NewSequence:
    return new_seq(seq_id=seq_id, request_id=f"r{seq_id}", token_ids=PROMPT[:13], prompt_len=13,
                   block_ids=block_ids, num_computed_tokens=num_computed,
                   num_scheduled_tokens=13 - num_computed + num_lookahead_slots,
                   num_lookahead_slots=num_lookahead_slots)


def run(h: Harness, step: StepPlan) -> list[tuple[int, int, int]]:
    """The step's draft forwards, as model_runner launches them (cache ops first)."""
    blocks = h.proposer.blocks
    blocks.swap_out(step.blocks_to_swap_out)
    blocks.swap_in(step.blocks_to_swap_in)
    blocks.copy(step.blocks_to_copy)
    h.mirrors.check(step, num_gpu_blocks=16)
    scheduled = h.mirrors.apply(step, is_checked=True)
    h.model.calls.clear()
    blocks.target_writes(scheduled)
    h.proposer.catch_up(scheduled, [])
    h.proposer.propose(scheduled, [])
    h.mirrors.mark_computed(scheduled)
    return [c for forward in h.model.calls for c in forward]


def test_a_prefix_hit_finds_the_draft_kv_only_where_a_sequence_drafted():
    h = Harness()
    # seq 1 drafts: its 13 tokens reach the draft model, blocks 1-3 full of them
    run(h, plan(1, new=[whole(1, [1, 2, 3, 4], 0)]))
    # seq 2 hits blocks 1 and 2 (8 tokens): the draft model starts after them
    calls = run(h, plan(2, new=[whole(2, [1, 2, 8, 9], 8)]))
    assert min(position for _, position, _ in calls) == 8
    # seq 3 computed its prompt while speculation was off: a hit on its blocks finds no draft KV
    run(h, plan(3, new=[whole(3, [10, 11, 12, 13], 0, num_lookahead_slots=0)]))
    calls = run(h, plan(4, new=[whole(4, [10, 11, 14, 15], 8)]))
    assert min(position for _, position, _ in calls) == 0


def test_swaps_carry_the_draft_kv_marks_and_a_reused_block_loses_its_mark():
    h = Harness()
    run(h, plan(1, new=[whole(1, [1, 2, 3, 4], 0)]))
    # swapped out and in to other blocks: its full blocks keep the draft KV
    h.mirrors.apply(plan(2, preempted_seq_ids=[1]), is_checked=True)
    calls = run(h, plan(3, new=[whole(1, [5, 6, 7, 8], 12)],
                        blocks_to_swap_out=[(1, 0), (2, 1), (3, 2)],
                        blocks_to_swap_in=[(0, 5), (1, 6), (2, 7)]))
    assert min(position for _, position, _ in calls) == 12
    # preempted by recompute: its blocks go to another prompt, which writes them from the start
    h.mirrors.apply(plan(4, preempted_seq_ids=[1]), is_checked=True)
    run(h, plan(5, new=[whole(2, [5, 6, 7, 9], 0, num_lookahead_slots=0)]))
    calls = run(h, plan(6, new=[whole(1, [5, 6, 10, 11], 8)]))
    assert min(position for _, position, _ in calls) == 0


def test_a_copy_carries_the_mark_and_an_import_drops_it():
    blocks = DraftBlocks(block_size=4)
    blocks.mark([1, 2], 0, 8)
    blocks.copy([(2, 3), (4, 1)])
    assert blocks.num_valid_tokens([3], 99) == 4 and blocks.num_valid_tokens([1], 99) == 0
    blocks.overwrite([3])
    assert blocks.num_valid_tokens([3, 2], 99) == 0
