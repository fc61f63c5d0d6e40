"""Scheduler + output processor on CPU with hand-built worker outputs (no model)."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.output_processor import OutputProcessor
from pagedserve.scheduler_svc.outputs import make_request_output
from pagedserve.scheduler_svc.scheduler import ScheduledStep, Scheduler
from pagedserve.scheduler_svc.sequence import SequenceGroup
from pagedserve.scheduler_svc.step_window import SentStep
from pagedserve.services.common.config import SchedulerConfig
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import (
    NewSequence,
    RunningSequence,
    SampledSequence,
    StepOutput,
)

EOS = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
GREEDY_LONG = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


class Harness:
    """A scheduler, its block manager and output processor; `step()` plays the worker by hand."""

    def __init__(self, num_gpu_blocks: int = 64, num_cpu_blocks: int = 64, block_size: int = 4,
                 max_model_len: int = 256, enable_prefix_caching: bool = False,
                 num_offload_blocks: int = 0, **scheduler_kw) -> None:
        self.bm = BlockManager(block_size, num_gpu_blocks, num_cpu_blocks, watermark=0.0,
                               enable_prefix_caching=enable_prefix_caching,
                               num_offload_blocks=num_offload_blocks)
        self.scheduler = Scheduler(SchedulerConfig(**scheduler_kw), self.bm, max_model_len)
        self.seq_ids = itertools.count()
        self.processor = OutputProcessor(self.scheduler, [EOS], max_model_len, self.seq_ids)
        self.arrival = itertools.count()
        self.groups: dict[str, SequenceGroup] = {}
        self.next_token = 10  # sampled ids count up from here, so every sample is distinct

    def add(self, request_id: str, prompt_len: int, sampling: SamplingParams = GREEDY,
            priority: int = 0) -> SequenceGroup:
        group = SequenceGroup.from_prompt(request_id, list(range(100, 100 + prompt_len)),
                                          sampling, next(self.seq_ids), priority,
                                          arrival_time=float(next(self.arrival)))
        self.scheduler.add_group(group)
        self.groups[request_id] = group
        return group

    def step(self, logprobs: dict[int, list[float]] | None = None, tokens=None):
        """One engine step; `logprobs[seq_id]` / `tokens[seq_id]` override the sampled values."""
        out = self.scheduler.schedule()
        rejected = [r for g in out.rejected if (r := make_request_output(g)) is not None]
        groups = self.take_in(SentStep(out, []), self.sample(out, logprobs, tokens))
        return out, rejected + self.processor.report(groups)

    def take_in(self, step: SentStep, output: StepOutput | None = None) -> list[SequenceGroup]:
        """The step's outputs (default: what sample() answers) into its sequences."""
        step.take_in()
        return self.processor.apply(step.scheduled, output or self.sample(step.scheduled))

    def sample(self, out: ScheduledStep, logprobs: dict[int, list[float]] | None = None,
               tokens=None) -> StepOutput:
        """What a worker would answer to the step: distinct token ids for every sample."""
        samples = []
        for item in out.scheduled:
            if item.is_sampling:
                sid = item.seq.seq_id
                ids = (tokens or {}).get(sid)
                if ids is None:
                    ids = list(range(self.next_token, self.next_token + item.num_samples))
                    self.next_token += item.num_samples
                lps = (logprobs or {}).get(sid, [-0.1 * (i + 1) for i in range(len(ids))])
                samples.append(SampledSequence(seq_id=sid, token_ids=ids, logprobs=lps))
        return StepOutput(out.plan.step_id if out.plan else 0, samples)

    def run_to_end(self, max_steps: int = 200) -> list:
        return self.run_while(self.scheduler.has_unfinished, max_steps)

    def run_while(self, has_work: Callable[[], bool], max_steps: int = 200) -> list:
        """Steps while `has_work()`; the reports of those steps."""
        reports = []
        for _ in range(max_steps):
            if not has_work():
                return reports
            reports += self.step()[1]
        raise AssertionError(f"{has_work.__name__}() still holds after {max_steps} steps")

    def swap_out_pair(self) -> SequenceGroup:
        """A greedy request, then a pair of samples that outgrows an 8-block device beside it:
        steps until the pair is swapped out, and returns it."""
        self.add("first", 4, GREEDY_LONG)
        group = self.add("pair", 4, SamplingParams(n=2, temperature=1.0, max_tokens=12,
                                                   ignore_eos=True))
        for _ in range(12):
            self.step()
            if self.scheduler.swapped:
                break
        assert list(self.scheduler.swapped) == [group]
        return group

    def all_free(self) -> bool:
        return (self.bm.num_free_gpu_blocks == self.bm.num_gpu_blocks
                and self.bm.num_free_cpu_blocks == self.bm.num_cpu_blocks)


def scheduled_ids(out: ScheduledStep) -> list[str]:
    return [item.group.request_id for item in out.scheduled]


def test_max_num_seqs_is_respected():
    h = Harness(max_num_seqs=2)
    for i in range(4):
        h.add(f"r{i}", 5)
    out, _ = h.step()
    assert scheduled_ids(out) == ["r0", "r1"]
    out, _ = h.step()
    assert len(out.scheduled) == 2  # r0, r1 decode; r2 waits for a slot
    h.run_to_end()
    assert h.all_free()


def test_token_budget_chunks_a_long_prompt():
    h = Harness(max_num_batched_tokens=8)
    h.add("long", 20)
    chunks = []
    for _ in range(3):
        out, reports = h.step()
        assert out.plan.num_scheduled_tokens <= 8
        chunks.append(out.plan)
    new, = chunks[0].new_seqs
    assert isinstance(new, NewSequence)
    assert (new.num_computed_tokens, new.num_scheduled_tokens, len(new.token_ids)) == (0, 8, 20)
    assert new.block_ids == h.bm.block_table(new.seq_id)  # 5 blocks of 4 for the whole prompt
    second, third = chunks[1].running_seqs[0], chunks[2].running_seqs[0]
    assert isinstance(second, RunningSequence)
    assert (second.num_scheduled_tokens, second.new_token_ids, second.block_ids) == (8, [], [])
    assert third.num_scheduled_tokens == 4
    assert reports[0].outputs[0].token_ids == [10]  # sampled only after the last chunk


def test_decodes_run_before_prefill_chunks():
    h = Harness(max_num_batched_tokens=6)
    h.add("a", 3)
    h.step()  # a's prompt; a now decodes
    h.add("b", 20)
    out, _ = h.step()
    assert scheduled_ids(out) == ["a", "b"]
    assert [i.num_scheduled_tokens for i in out.scheduled] == [1, 5]
    assert out.plan.running_seqs == []
    assert out.plan.decode_seq_ids == [out.scheduled[0].seq.seq_id]  # packed: the worker has 10


def test_without_chunked_prefill_a_step_is_all_prompts_or_all_decodes():
    h = Harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    h.add("a", 3)
    h.step()
    h.add("b", 20)  # longer than the budget: runs alone, whole (budget grows to max_model_len)
    out, _ = h.step()
    assert scheduled_ids(out) == ["b"] and out.scheduled[0].num_scheduled_tokens == 20
    out, _ = h.step()
    assert sorted(scheduled_ids(out)) == ["a", "b"]
    assert all(i.num_scheduled_tokens == 1 for i in out.scheduled)


def test_fcfs_runs_in_arrival_order():
    h = Harness(max_num_seqs=1)
    h.add("first", 3)
    h.add("second", 3, priority=-5)  # ignored under fcfs
    out, _ = h.step()
    assert scheduled_ids(out) == ["first"]


def test_priority_runs_lower_value_first_then_arrival():
    h = Harness(max_num_seqs=1, policy="priority")
    h.add("low", 3, priority=5)
    h.add("high_late", 3, priority=0)
    h.add("high_later", 3, priority=0)
    order = []
    for _ in range(30):
        out, reports = h.step()
        order += [r.request_id for r in reports if r.finished]
    assert order == ["high_late", "high_later", "low"]


def test_recompute_preemption_resends_the_whole_sequence():
    # 4 blocks of 4 tokens: two 6-token prompts take 2 blocks each; computing position 8 needs a
    # third block for the first, so the later request is preempted by recompute
    h = Harness(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4)
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a, b = h.add("a", 6, sampling), h.add("b", 6, sampling)
    for _ in range(3):  # prompt, then positions 6 and 7
        out, _ = h.step()
        assert not out.plan.preempted_seq_ids
    out, _ = h.step()
    b_seq = b.seqs[0]
    assert out.plan.preempted_seq_ids == [b_seq.seq_id]
    assert scheduled_ids(out) == ["a"] and not out.plan.blocks_to_swap_out
    assert h.scheduler.num_preemptions == 1 and list(h.scheduler.waiting) == [b]
    for _ in range(10):
        out, _ = h.step()
        resent = [s for s in out.plan.new_seqs if s.seq_id == b_seq.seq_id]
        if resent:
            break
    resent, = resent
    assert resent.num_computed_tokens == 0 and resent.prompt_len == 6
    assert resent.token_ids == b_seq.token_ids[:len(resent.token_ids)]
    assert len(resent.token_ids) == 9  # prompt + the 3 outputs sampled before the preemption
    assert resent.num_scheduled_tokens == 9
    reports = h.run_to_end()
    assert a.seqs[0].num_output_tokens == 6 and b_seq.num_output_tokens == 6
    assert all(r.outputs[0].finish_reason == "length" for r in reports if r.finished)
    assert h.all_free()


def test_swap_preemption_moves_blocks_and_resends_with_computed_tokens():
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=8, block_size=4)
    sampling = SamplingParams(n=2, temperature=1.0, max_tokens=8, ignore_eos=True)
    h.add("first", 4, GREEDY_LONG)
    group = h.add("pair", 4, sampling)
    h.step()  # both prompts; "pair" forks into two sequences
    assert len(group.seqs) == 2
    swapped_at = None
    for step in range(12):
        out, _ = h.step()
        if out.plan.blocks_to_swap_out:
            swapped_at = step
            break
    assert swapped_at is not None, "the tiny pool must force a swap"
    seq_ids = sorted(s.seq_id for s in group.seqs)
    assert sorted(out.plan.preempted_seq_ids) == seq_ids
    assert list(h.scheduler.swapped) == [group]
    assert all(h.bm.is_swapped(sid) for sid in seq_ids)
    computed = {s.seq_id: s.num_computed_tokens for s in group.seqs}
    for _ in range(20):
        out, _ = h.step()
        if out.plan and out.plan.blocks_to_swap_in:
            break
    resent = {s.seq_id: s for s in out.plan.new_seqs}
    assert sorted(resent) == seq_ids
    assert all(resent[sid].num_computed_tokens == computed[sid] for sid in seq_ids)
    assert len({cpu for cpu, _ in out.plan.blocks_to_swap_in}) == len(out.plan.blocks_to_swap_in)
    h.run_to_end()
    assert all(s.num_output_tokens == 8 for s in group.seqs)
    assert h.all_free()


def test_never_fitting_prompts_fail_alone():
    h = Harness(num_gpu_blocks=4, block_size=4, max_model_len=64)
    h.add("huge", 30)  # 8 blocks > 4 in the device
    h.add("too_long", 64)  # not shorter than max_model_len
    h.add("ok", 5)
    out, reports = h.step()
    assert scheduled_ids(out) == ["ok"]
    by_id = {r.request_id: r for r in reports}
    for rid in ("huge", "too_long"):
        assert by_id[rid].finished
        assert by_id[rid].outputs[0].finish_reason == "error"
        assert by_id[rid].outputs[0].error
    h.run_to_end()
    assert h.all_free()


def test_forked_group_copies_the_shared_last_block():
    h = Harness(block_size=4)
    sampling = SamplingParams(n=3, temperature=1.0, max_tokens=3, ignore_eos=True)
    group = h.add("n3", 6, sampling)  # the second block is half full, shared after the fork
    out, reports = h.step()
    assert out.scheduled[0].num_samples == 3
    assert len(group.seqs) == 3 and [r.outputs for r in reports][0]
    parent = group.seqs[0]
    shared = h.bm.block_table(parent.seq_id)
    out, _ = h.step()
    children = {s.seq_id for s in out.plan.new_seqs}
    assert children == {s.seq_id for s in group.seqs[1:]}
    # the half-full second block is written by all three: two writers get a private copy
    assert sorted(src for src, _ in out.plan.blocks_to_copy) == [shared[1], shared[1]]
    second_blocks = {h.bm.block_table(s.seq_id)[1] for s in group.seqs}
    assert second_blocks == {shared[1]} | {dst for _, dst in out.plan.blocks_to_copy}
    for new in out.plan.new_seqs:
        assert new.num_computed_tokens == 6 and new.num_scheduled_tokens == 1
        assert new.block_ids[0] == shared[0]  # the full first block stays shared
    parent_delta, = out.plan.running_seqs
    assert parent_delta.new_token_ids == parent.token_ids[6:7]
    # the parent runs first, so it writes into a copy: its table delta replaces block 1
    assert parent_delta.block_ids_start == 1
    assert parent_delta.block_ids == [h.bm.block_table(parent.seq_id)[1]] != [shared[1]]
    h.run_to_end()
    assert h.all_free()


def test_abort_frees_everything():
    h = Harness(max_num_batched_tokens=8)
    h.add("a", 20)
    h.add("b", 3)
    h.step()
    for group in list(h.groups.values()):
        h.scheduler.finish_group(group, "abort")
    assert not h.scheduler.has_unfinished()
    out, _ = h.step()
    assert out.plan is None
    assert h.all_free()


def test_recompute_of_a_forked_group_samples_all_sequences_together():
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=0, block_size=4, preemption_mode="recompute")
    first = h.add("first", 4, GREEDY_LONG)
    pair = h.add("pair", 4, SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True))
    h.step()
    for _ in range(10):
        out, _ = h.step()
        if out.plan.preempted_seq_ids:
            break
    assert sorted(out.plan.preempted_seq_ids) == sorted(s.seq_id for s in pair.seqs)
    tokens_before = [list(s.token_ids) for s in pair.seqs]
    while not pair.seqs[0].is_known_to_worker:
        out, _ = h.step()
    resent = [s for s in out.plan.new_seqs if s.request_id == "pair"]
    assert [s.num_scheduled_tokens for s in resent] == [len(t) - 1 for t in tokens_before]
    assert not any(i.is_sampling for i in out.scheduled if i.group is pair)
    out, _ = h.step()
    pair_items = [i for i in out.scheduled if i.group is pair]
    assert len(pair_items) == 2 and all(i.is_sampling for i in pair_items)
    h.run_to_end()
    assert first.is_finished and all(s.num_output_tokens == 6 for s in pair.seqs)
    assert [s.token_ids[:len(t)] for s, t in zip(pair.seqs, tokens_before, strict=True)] == tokens_before
    assert h.all_free()


def test_swap_without_cpu_room_falls_back_to_recompute():
    h = Harness(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4, preemption_mode="swap")
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    h.add("a", 6, sampling)
    b = h.add("b", 6, sampling)
    for _ in range(4):
        out, _ = h.step()
    assert out.plan.preempted_seq_ids == [b.seqs[0].seq_id] and not out.plan.blocks_to_swap_out
    assert list(h.scheduler.waiting) == [b]
    h.run_to_end()
    assert h.all_free()


def test_the_victim_is_the_lowest_priority_running_group():
    h = Harness(num_gpu_blocks=4, num_cpu_blocks=0, block_size=4, policy="priority")
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    low = h.add("low", 6, sampling, priority=9)
    high = h.add("high", 6, sampling, priority=0)
    for _ in range(4):
        out, _ = h.step()
    assert out.plan.preempted_seq_ids == [low.seqs[0].seq_id]
    assert high.seqs[0].status.value == "running"


def test_a_higher_priority_arrival_takes_the_seq_slot_of_the_lowest_running_group():
    h = Harness(max_num_seqs=2, policy="priority")
    h.add("low_early", 3, GREEDY_LONG, priority=5)
    low_late = h.add("low_late", 3, GREEDY_LONG, priority=5)
    h.step()
    h.add("high", 3, GREEDY_LONG, priority=0)
    out, _ = h.step()
    assert sorted(scheduled_ids(out)) == ["high", "low_early"]  # admitted in the same step
    assert out.plan.preempted_seq_ids == [low_late.seqs[0].seq_id]
    assert list(h.scheduler.waiting) == [low_late] and low_late.seqs[0].num_computed_tokens == 0
    h.run_to_end()
    assert h.all_free() and h.scheduler.num_preemptions == 1


def test_a_higher_priority_arrival_takes_the_blocks_of_lower_running_groups():
    h = Harness(num_gpu_blocks=6, num_cpu_blocks=4, block_size=4, policy="priority")
    low = h.add("low", 12, GREEDY_LONG, priority=5)  # 3 blocks
    mid = h.add("mid", 8, GREEDY_LONG, priority=3)  # 2 blocks
    h.step()
    h.add("high", 8, GREEDY_LONG, priority=0)  # 2 blocks, 1 free: only low has to go
    out, _ = h.step()
    assert "high" in scheduled_ids(out) and "mid" in scheduled_ids(out)
    assert out.plan.preempted_seq_ids == [low.seqs[0].seq_id]
    assert not out.plan.blocks_to_swap_out  # by recompute: a swapped group would block waiting
    assert mid.seqs[0].status.value == "running"
    h.run_to_end()
    assert h.all_free()


@pytest.mark.parametrize("num_gpu_blocks, finish_reason", [(8, "length"), (6, "error")])
def test_a_group_that_needs_nearly_or_more_than_the_whole_device_never_stalls(
        num_gpu_blocks, finish_reason):
    # two sequences of 16 tokens share one prompt block: 7 blocks in all
    h = Harness(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=8, block_size=4)
    h.add("first", 4, GREEDY_LONG)
    h.add("pair", 4, SamplingParams(n=2, temperature=1.0, max_tokens=12, ignore_eos=True))
    reports = {r.request_id: r for r in h.run_to_end(max_steps=60) if r.finished}
    # with 8 blocks it comes back from swap once alone (no margin is needed then); with 6 it
    # cannot grow even alone on the device, and fails instead of swapping in and out forever
    assert [o.finish_reason for o in reports["pair"].outputs] == [finish_reason] * 2
    assert reports["first"].outputs[0].finish_reason == "length"
    assert h.all_free()


def test_a_swapped_group_holds_back_later_arrivals_unless_they_outrank_it():
    for policy, priority, admitted in (("fcfs", 0, False), ("priority", -1, True)):
        h = Harness(num_gpu_blocks=8, num_cpu_blocks=8, block_size=4, policy=policy)
        h.swap_out_pair()
        h.add("late", 2, GREEDY, priority=priority)
        out, _ = h.step()
        assert ("late" in scheduled_ids(out)) is admitted, policy
        assert (not h.scheduler.waiting) is admitted, policy
        h.run_to_end()
        assert h.all_free()


def test_no_priority_preemption_for_an_equal_rank_a_hopeless_prompt_or_fcfs():
    for policy, priority in (("priority", 5), ("fcfs", 0)):
        h = Harness(max_num_seqs=1, policy=policy)
        h.add("running", 3, GREEDY_LONG, priority=5)
        h.step()
        h.add("newcomer", 3, GREEDY_LONG, priority=priority)
        out, _ = h.step()
        assert scheduled_ids(out) == ["running"] and not out.plan.preempted_seq_ids
    h = Harness(num_gpu_blocks=4, block_size=4, policy="priority")
    h.add("running", 3, GREEDY_LONG, priority=5)
    h.step()
    h.add("huge", 20, GREEDY_LONG, priority=0)  # 5 blocks: more than the device has
    out, reports = h.step()
    assert scheduled_ids(out) == ["running"] and not out.plan.preempted_seq_ids
    assert [r.request_id for r in reports if r.finished] == ["huge"]


def test_a_recomputed_group_too_big_for_the_pool_fails_instead_of_stalling():
    h = Harness(num_gpu_blocks=5, num_cpu_blocks=0, block_size=4, preemption_mode="recompute")
    h.add("first", 4, GREEDY_LONG)
    pair = h.add("pair", 4, SamplingParams(n=2, temperature=1.0, max_tokens=6, ignore_eos=True))
    reports = h.run_to_end(max_steps=40)
    final = [r for r in reports if r.request_id == "pair" and r.finished]
    assert final and all(o.finish_reason == "error" for o in final[0].outputs)
    assert pair.is_finished and h.all_free()


def test_a_request_owed_prompt_logprobs_skips_the_prefix_cache():
    """A hit would skip positions whose logprobs it asked for (vLLM skips the cache too)."""
    h = Harness(enable_prefix_caching=True)
    h.add("first", 13)
    h.run_to_end()
    logprobs = h.add("logprobs", 13, SamplingParams(temperature=0.0, max_tokens=2,
                                                    prompt_logprobs=1))
    plain = h.add("plain", 13)
    h.step()
    assert (logprobs.num_cached_tokens, plain.num_cached_tokens) == (0, 12)


@pytest.mark.parametrize("num_gpu_blocks, preempted", [(6, []), (5, ["c"])])
def test_decodes_that_each_need_a_block_fill_the_pool_exactly_or_preempt(num_gpu_blocks,
                                                                         preempted):
    """Three decodes at a block boundary need a block each: with three free all run, with two
    the last arrival is preempted (the scheduler skips the per-group check only while every
    decode surely fits)."""
    h = Harness(num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=0, block_size=4)
    sampling = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    groups = {name: h.add(name, 4, sampling) for name in "abc"}
    h.step()  # the prompts: a block each, full
    out, _ = h.step()  # position 4 of each: a second block
    seq_ids = {g.seqs[0].seq_id: name for name, g in groups.items()}
    assert [seq_ids[s] for s in out.plan.preempted_seq_ids] == preempted
    assert scheduled_ids(out) == [n for n in "abc" if n not in preempted]
    assert h.bm.num_free_gpu_blocks == len(preempted)  # a preempted prompt gives its block back
    h.run_to_end()
    assert all(g.seqs[0].num_output_tokens == 6 for g in groups.values()) and h.all_free()


def test_forked_decodes_sharing_their_last_block_fill_the_pool_exactly():
    """Two sequences forked on a partial block: the first to write it copies it, the second then
    holds it alone, so two free blocks are one more than they need."""
    h = Harness(num_gpu_blocks=4, num_cpu_blocks=8, block_size=4)
    group = h.add("pair", 6, SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True))
    h.step()  # 2 blocks; the fork shares both
    out, _ = h.step()  # position 6 of each, in the shared partial block
    assert len(out.plan.blocks_to_copy) == 1 and not out.plan.preempted_seq_ids
    assert h.bm.num_free_gpu_blocks == 1
    h.run_to_end()
    assert all(s.num_output_tokens == 3 for s in group.seqs) and h.all_free()
