"""Speculative slots in the scheduler: drafts in the plan and the budget, the block-table tail
given back after verification, what the prefix cache learns, and when speculation stands aside."""

from __future__ import annotations

import json

import pytest
from pagedserve.scheduler_svc.prefix_cache import hash_prompt_blocks
from pagedserve.scheduler_svc.sequence import SequenceGroup
from pagedserve.scheduler_svc.step_window import SentStep
from pagedserve.services.common.config import SchedulerConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import SampledSequence, StepOutput
from pagedserve.services.common.structured_outputs import StructuredOutputsParams

from tests.unit.test_scheduler import Harness

NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
                    "prompt_lookup_min": 2, "adaptive": False})
# 12 tokens: [1..6] twice, so after the prompt's first decoded token 1.. the drafts follow
PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 5, 6]
LONG = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


class SpecHarness(Harness):
    def __init__(self, accept, **kw) -> None:
        """accept(drafts) → the most of them the fake worker accepts (those that are right)."""
        kw.setdefault("block_size", 4)
        super().__init__(speculative_config=kw.pop("speculative_config", NGRAM), **kw)
        self.accept = accept

    def add_prompt(self, request_id: str, prompt: list[int],
                   sampling: SamplingParams = LONG) -> SequenceGroup:
        group = SequenceGroup.from_prompt(request_id, list(prompt), sampling,
                                          next(self.seq_ids), arrival_time=float(len(self.groups)))
        self.scheduler.add_group(group)
        self.groups[request_id] = group
        return group

    def sample(self, out, logprobs=None, tokens=None) -> StepOutput:
        """Continues the prompt's cycle 1..6: a draft that follows it is right."""
        samples = []
        for item in out.scheduled:
            if not item.is_sampling:
                continue
            seq = item.seq
            if item.num_samples > 1:
                ids = list(range(self.next_token, self.next_token + item.num_samples))
                self.next_token += item.num_samples
            else:
                drafts = item.draft_token_ids or []
                ids = []
                for draft in drafts[:self.accept(drafts)]:
                    if draft != _cycle_after(seq.token_ids + ids):
                        break
                    ids.append(draft)
                ids.append(_cycle_after(seq.token_ids + ids))
            samples.append(SampledSequence(seq.seq_id, ids, [-0.5] * len(ids)))
        return StepOutput(out.plan.step_id, samples)


def _cycle_after(token_ids: list[int]) -> int:
    return token_ids[-1] % 6 + 1


def _first_decode(h: SpecHarness):
    h.step()  # the prompt, sampling 1
    return h.step()


def test_a_verified_step_carries_the_drafts_and_counts_them_in_the_budget():
    h = SpecHarness(accept=len)
    group = h.add_prompt("r", PROMPT)
    out, _ = _first_decode(h)
    item, = out.scheduled
    assert item.draft_token_ids == [2, 3, 4, 5]
    assert item.num_scheduled_tokens == 5 and out.plan.num_scheduled_tokens == 5
    delta, = out.plan.running_seqs
    assert delta.draft_token_ids == [2, 3, 4, 5] and delta.num_scheduled_tokens == 5
    seq = group.seqs[0]
    assert seq.token_ids == PROMPT + [1, 2, 3, 4, 5, 6]  # 4 accepted drafts and the next token
    assert seq.num_computed_tokens == len(seq.token_ids) - 1


def test_a_spec_factor_sizes_each_steps_drafts_by_the_match():
    config = {**json.loads(NGRAM), "num_speculative_tokens": 12,
              "prompt_lookup_max_spec_factor": 0.5}
    h = SpecHarness(accept=len, speculative_config=json.dumps(config))
    h.add_prompt("r", PROMPT)
    out, _ = _first_decode(h)
    # the sequence's last 7 tokens [1..6, 1] agree with its first 7: 3 drafts
    assert out.scheduled[0].draft_token_ids == [2, 3, 4]
    out, _ = h.step()
    # [2, 3, 4] kept, 5 drawn: the last 11 tokens agree with the 11 ending six earlier
    assert out.scheduled[0].draft_token_ids == [6, 1, 2, 3, 4]


def test_drafts_fit_in_what_the_token_budget_leaves():
    h = SpecHarness(accept=lambda drafts: 0, max_num_batched_tokens=3, enable_chunked_prefill=True)
    h.add_prompt("r", PROMPT)
    for _ in range(4):  # 12 prompt tokens in chunks of 3
        h.step()
    out, _ = h.step()
    item, = out.scheduled
    assert item.draft_token_ids == [2, 3] and item.num_scheduled_tokens == 3


def test_rejected_drafts_give_their_blocks_back_and_the_worker_table_is_trimmed():
    h = SpecHarness(accept=lambda drafts: 0, num_gpu_blocks=16)
    group = h.add_prompt("r", PROMPT)
    seq = group.seqs[0]
    h.step()  # 12 tokens: 3 blocks, then token 13 sampled
    out = h.scheduler.schedule()
    item, = out.scheduled
    assert item.draft_token_ids == [2, 3, 4, 5]
    # tokens 13..17 (the last known one and 4 drafts) need a 4th and a 5th block
    assert len(h.bm.block_table(seq.seq_id)) == 5
    h.take_in(SentStep(out, []))
    assert seq.num_computed_tokens == 13 and len(seq.token_ids) == 14
    assert len(h.bm.block_table(seq.seq_id)) == 4  # the 5th held rejected drafts only
    assert h.bm.num_free_gpu_blocks == 16 - 4
    out = h.scheduler.schedule()
    delta, = out.plan.running_seqs
    # the worker's copy of the table: its first 4 blocks kept, the tail replaced
    assert delta.block_ids_start == 4
    assert h.bm.block_table(seq.seq_id)[4:] == delta.block_ids


def test_rejected_drafts_never_reach_the_prefix_cache():
    """Were the rejected drafts counted as computed, the block holding them would be hashed
    under the tokens that later replace them, and serve another prompt the drafts' KV."""
    accepted = iter([1, 0, 2, 0, 3, 0, 1] * 10)
    h = SpecHarness(accept=lambda drafts: min(next(accepted), len(drafts)),
                    enable_prefix_caching=True)
    group = h.add_prompt("r", [*PROMPT, 9])  # the cycle breaks: drafts go wrong sometimes
    seq = group.seqs[0]
    for _ in range(12):
        h.step()
        if seq.is_finished:
            break
        assert seq.num_computed_tokens == len(seq.token_ids) - 1
        blocks = h.bm._seqs[seq.seq_id]
        num_full = seq.num_computed_tokens // h.bm.block_size
        real = hash_prompt_blocks(seq.token_ids, h.bm.block_size, num_full)
        assert blocks.block_hashes == real[:len(blocks.block_hashes)]
        assert len(blocks.block_hashes) >= num_full - 2  # hashed a step late at most
    h.run_to_end()
    assert h.all_free()


def test_no_drafts_for_beam_search_or_before_a_fork_and_for_each_sibling_after():
    h = SpecHarness(accept=len)
    h.add_prompt("beam", PROMPT, SamplingParams(n=2, use_beam_search=True, temperature=0.0,
                                                max_tokens=6, ignore_eos=True))
    pair = h.add_prompt("pair", PROMPT, SamplingParams(n=2, temperature=1.0, max_tokens=30,
                                                       ignore_eos=True))
    for _ in range(3):
        out, _ = h.step()
        for item in out.scheduled:
            if item.group.request_id == "beam" or item.num_samples > 1:
                assert not item.draft_token_ids
    out, _ = h.step()
    pair_items = [i for i in out.scheduled if i.group is pair]
    assert len(pair_items) == 2 and all(i.draft_token_ids for i in pair_items)
    h.run_to_end()
    assert h.all_free()
    for seq in pair.seqs:  # each sibling went on by its own cycle, drafts and all
        outputs = seq.output_token_ids[1:]
        assert all(b == a % 6 + 1 for a, b in zip(outputs, outputs[1:], strict=False))


def test_no_drafts_for_a_constrained_request_beside_one_that_speculates():
    h = SpecHarness(accept=len)
    constrained = h.add_prompt("json", PROMPT, SamplingParams(
        temperature=0.0, max_tokens=8, ignore_eos=True,
        structured_outputs=StructuredOutputsParams(json_object=True)))
    free = h.add_prompt("free", PROMPT, SamplingParams(temperature=0.0, max_tokens=8,
                                                       ignore_eos=True))
    drafted = set()
    for _ in range(4):
        out, _ = h.step()
        drafted |= {item.group.request_id for item in out.scheduled if item.draft_token_ids}
    assert drafted == {"free"}
    h.run_to_end()
    assert constrained.is_finished and free.is_finished and h.all_free()


def test_speculation_survives_preemption_by_swap_and_by_recompute():
    for mode in ("swap", "recompute"):
        h = SpecHarness(accept=lambda drafts: len(drafts) // 2, num_gpu_blocks=14,
                        preemption_mode=mode)
        groups = [h.add_prompt(f"r{i}", PROMPT) for i in range(3)]
        h.run_to_end()
        assert h.scheduler.num_preemptions > 0, mode
        assert h.all_free()
        for group in groups:
            outputs = group.seqs[0].output_token_ids
            assert len(outputs) == 40
            assert all(b == a % 6 + 1 for a, b in zip(outputs, outputs[1:], strict=False)), mode


def test_only_a_step_with_drafts_holds_run_ahead_back():
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 2})
    h = SpecHarness(accept=len, speculative_config=config)
    h.add_prompt("free", list(range(100, 140)))  # nothing ever matches
    h.step()
    out, _ = h.step()
    assert out.scheduled[0].draft_token_ids == [] and out.may_run_ahead
    h.add_prompt("copy", PROMPT)
    h.step()
    out, _ = h.step()
    assert [item.draft_token_ids for item in out.scheduled] == [[], [2, 3]]
    assert not out.may_run_ahead


def test_a_step_sent_behind_one_in_flight_drafts_past_the_token_being_drawn():
    h = SpecHarness(accept=len)
    group = h.add_prompt("r", PROMPT)
    in_flight = SentStep(h.scheduler.schedule(), [])  # the prompt, drawing its first token
    assert in_flight.scheduled.may_run_ahead
    in_flight.advance()
    behind = h.scheduler.schedule()
    item, = behind.scheduled
    # the prompt's match guesses the token being drawn (1) and drafts what followed it
    assert item.draft_token_ids == [2, 3, 4, 5] and item.num_scheduled_tokens == 5
    assert not behind.may_run_ahead
    h.take_in(in_flight)
    h.take_in(SentStep(behind, []))
    assert group.seqs[0].output_token_ids == [1, 2, 3, 4, 5, 6]
    h.run_to_end()
    assert h.all_free()


def test_a_step_whose_drafts_did_not_pay_runs_ahead_and_keeps_the_slots_behind_it():
    h = SpecHarness(accept=len)
    group = h.add_prompt("r", PROMPT)
    h.step()  # the prompt samples 1
    speculator = h.scheduler.speculator
    speculator.drafts_that_pay = lambda scheduled: [0] * len(scheduled)
    in_flight = SentStep(h.scheduler.schedule(), [])
    assert in_flight.scheduled.scheduled[0].draft_token_ids == []
    assert in_flight.scheduled.may_run_ahead
    in_flight.advance()
    del speculator.drafts_that_pay
    behind = h.scheduler.schedule()
    assert behind.scheduled[0].draft_token_ids == [3, 4, 5, 6]
    h.take_in(in_flight)
    h.take_in(SentStep(behind, []))
    assert group.seqs[0].output_token_ids == [1, 2, 3, 4, 5, 6, 1]
    h.run_to_end()
    assert h.all_free()


@pytest.mark.parametrize(("value", "match"), [
    ('{"method": "eagle"}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"prompt_lookup_min": 5, "prompt_lookup_max": 3}', "prompt_lookup_min"),
    ('{"num_speculative_tokens": "4"}', "num_speculative_tokens must be an integer"),
    ('{"draft_model": "x"}', "unknown keys"),
    ('{"disable_by_batch_size": -1}', "disable_by_batch_size must be >= 0"),
    ('{"prompt_lookup_max_spec_factor": -1.5}', "prompt_lookup_max_spec_factor must be >= 0"),
    ('{"prompt_lookup_max_spec_factor": true}', "prompt_lookup_max_spec_factor must be a number"),
    ("ngram", "must be a JSON object"),
])
def test_a_bad_speculative_config_is_refused_by_name(value, match):
    with pytest.raises(ConfigError, match=match):
        SchedulerConfig(speculative_config=value)


def test_the_speculative_config_may_be_a_dict():
    config = SchedulerConfig(speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert config.speculative.num_speculative_tokens == 2
    assert config.speculative.prompt_lookup_max_spec_factor == 0.0
    assert SchedulerConfig().speculative is None
