"""Backpressure in the scheduler core: a paused group (its consumer is behind) is skipped, keeps
its blocks, is the first preempted under memory pressure, and continues where it stopped."""

from __future__ import annotations

from pagedserve.services.common.sampling_params import SamplingParams

from tests.unit.test_scheduler import GREEDY_LONG, Harness, scheduled_ids

SIX = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FOUR = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def run_runnable(h: Harness) -> list:
    """Steps until only paused groups (or none) are left; their reports."""
    return h.run_while(h.scheduler.has_runnable)


def test_a_paused_group_is_not_scheduled_keeps_its_blocks_and_resumes_where_it_stopped():
    h = Harness()
    slow, fast = h.add("slow", 5, GREEDY_LONG), h.add("fast", 5, GREEDY_LONG)
    for _ in range(3):
        h.step()
    slow.is_paused = True
    num_tokens = len(slow.seqs[0].token_ids)
    blocks = h.bm.block_table(slow.seqs[0].seq_id)
    for _ in range(5):
        out, _ = h.step()
        assert scheduled_ids(out) == ["fast"]
    assert len(slow.seqs[0].token_ids) == num_tokens
    assert h.bm.block_table(slow.seqs[0].seq_id) == blocks
    assert h.scheduler.num_paused == 1 and h.scheduler.has_runnable()
    run_runnable(h)
    assert fast.is_finished and not slow.is_finished
    assert h.scheduler.has_unfinished() and not h.scheduler.has_runnable()
    out, _ = h.step()
    assert out.plan is None  # nothing to do while every group is paused

    slow.is_paused = False
    out, _ = h.step()
    assert scheduled_ids(out) == ["slow"]
    assert not out.plan.new_seqs  # the worker still holds its KV: no recompute
    h.run_to_end()
    assert slow.seqs[0].num_output_tokens == 12 and h.scheduler.num_preemptions == 0
    assert h.all_free()


def test_a_paused_group_is_preempted_before_a_lower_ranked_running_one():
    # as in test_recompute_preemption_resends_the_whole_sequence the pool runs out at the 4th
    # step, where the later "b" would be the victim; with the earlier "a" paused, "a" is
    h = Harness(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4)
    a, b = h.add("a", 6, SIX), h.add("b", 6, SIX)
    for _ in range(3):
        h.step()
    a.is_paused = True
    out, _ = h.step()
    assert out.plan.preempted_seq_ids == [a.seqs[0].seq_id]
    assert scheduled_ids(out) == ["b"] and list(h.scheduler.waiting) == [a]
    for _ in range(5):
        out, _ = h.step()
        assert "a" not in scheduled_ids(out)  # waiting, still paused: not admitted
    a.is_paused = False
    h.run_to_end()
    assert a.seqs[0].num_output_tokens == 6 and b.seqs[0].num_output_tokens == 6
    assert h.all_free()


def test_a_waiting_prompt_with_no_room_preempts_a_paused_group():
    h = Harness(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4)
    paused = h.add("paused", 12, FOUR)  # 3 of the 4 blocks, 4 when done
    h.step()
    paused.is_paused = True
    h.add("late", 6, SIX)  # 2 blocks: only the paused group's can make room
    out, _ = h.step()
    assert scheduled_ids(out) == ["late"]
    assert out.plan.preempted_seq_ids == [paused.seqs[0].seq_id]
    assert paused in h.scheduler.waiting and h.scheduler.num_paused == 1
    reports = run_runnable(h)
    assert [r.request_id for r in reports if r.finished] == ["late"]
    paused.is_paused = False
    h.run_to_end()
    assert paused.seqs[0].num_output_tokens == 4 and h.all_free()


def test_a_paused_swapped_group_neither_comes_back_nor_holds_back_later_arrivals():
    h = Harness(num_gpu_blocks=8, num_cpu_blocks=8, block_size=4)
    group = h.swap_out_pair()
    group.is_paused = True
    h.add("late", 2, FOUR)
    out, _ = h.step()
    assert "late" in scheduled_ids(out)  # unpaused, a swapped group would hold it back
    for _ in range(20):
        h.step()
    assert list(h.scheduler.swapped) == [group] and not h.scheduler.running
    group.is_paused = False
    h.run_to_end()
    assert all(s.num_output_tokens == 12 for s in group.seqs) and h.all_free()


def test_priority_preemption_passes_over_a_paused_waiting_group():
    h = Harness(max_num_seqs=1, policy="priority")
    low = h.add("low", 3, GREEDY_LONG, priority=5)
    h.step()
    high = h.add("high", 3, GREEDY_LONG, priority=0)
    high.is_paused = True
    out, _ = h.step()
    assert scheduled_ids(out) == ["low"] and h.scheduler.num_preemptions == 0
    assert low.seqs[0].num_output_tokens == 2
