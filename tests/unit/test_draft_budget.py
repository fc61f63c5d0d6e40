"""The batch-aware draft budget: the step's cost per token and a draft model's per position learned
from timings, drafts cut where they cost more than they are likely to save (a draft model's
steps then run ahead), and vLLM's disable_by_batch_size."""

from __future__ import annotations

import json

import pytest
from pagedserve.scheduler_svc.scheduled_step import ScheduledSequence
from pagedserve.scheduler_svc.sequence import PLACEHOLDER_TOKEN_ID, SequenceGroup
from pagedserve.scheduler_svc.spec_decode import Speculator
from pagedserve.scheduler_svc.step_cost import StepCostModel
from pagedserve.scheduler_svc.step_window import SentStep
from pagedserve.services.common.speculative_config import SpeculativeConfig
from pagedserve.services.common.step_plan import StepTimings

from tests.unit.test_spec_decode_scheduler import LONG, PROMPT, SpecHarness

ADAPTIVE = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}


def test_the_cost_line_is_learned_from_step_times():
    model = StepCostModel()
    assert model.line() == (0.0, 0.0)
    for _ in range(5):
        model.record(8, 0.040)
    assert model.line() == pytest.approx((0.040, 0.0))  # one token count: no slope yet
    for _ in range(20):
        for n in (8, 16, 24, 40):
            model.record(n, 0.010 + 0.004 * n)
    assert model.line() == pytest.approx((0.010, 0.004), rel=0.05)


def _decoding(h: SpecHarness, num_requests: int):
    for i in range(num_requests):
        h.add_prompt(f"r{i}", PROMPT)
    h.step()  # the prompts, each sampling 1
    return h.scheduler.schedule()


def _with_cost(fixed_s: float, per_token_s: float, accept):
    h = SpecHarness(accept=accept, speculative_config=json.dumps(ADAPTIVE))
    for _ in range(20):
        for n in (8, 16, 24, 40):
            h.scheduler.speculator.step_cost.record(n, fixed_s + per_token_s * n)
    return h


@pytest.mark.parametrize("num_requests", [1, 8])
def test_drafts_that_are_likely_kept_are_verified_where_a_token_costs_little(num_requests):
    h = _with_cost(0.100, 0.001, accept=len)  # memory-bound
    out = _decoding(h, num_requests)
    assert [len(item.draft_token_ids) for item in out.scheduled] == [4] * num_requests


def test_where_a_token_costs_its_share_only_drafts_likely_kept_are_verified():
    # compute-bound: a draft pays at batch 8 only if kept with probability > 2/3
    h = _with_cost(0.040, 0.010, accept=lambda drafts: 0)
    speculator = h.scheduler.speculator
    out = _decoding(h, 8)
    # no record yet: the optimistic prior verifies one draft each
    assert [len(item.draft_token_ids) for item in out.scheduled] == [1] * 8
    for _ in range(3):  # every draft rejected: the rate falls
        h.take_in(_sent(out))
        out = h.scheduler.schedule()
    assert [item.draft_token_ids for item in out.scheduled] == [[]] * 8
    assert out.plan.num_scheduled_tokens == 8 and out.may_run_ahead
    assert speculator.totals.num_accepted_tokens == 0
    h.run_to_end()
    assert h.all_free()


def _sent(out) -> SentStep:
    return SentStep(out, [])


@pytest.mark.parametrize(("limit", "num_requests", "drafted"), [(3, 3, False), (4, 3, True),
                                                                  (0, 8, True)])
def test_disable_by_batch_size_turns_drafts_off_from_that_many_running(limit, num_requests,
                                                                       drafted):
    config = {**ADAPTIVE, "adaptive": False, "disable_by_batch_size": limit}
    h = SpecHarness(accept=len, speculative_config=json.dumps(config))
    out = _decoding(h, num_requests)
    assert all(bool(item.draft_token_ids) is drafted for item in out.scheduled)
    assert out.may_run_ahead is not drafted


def _speculator_with_cost(fixed_s: float, per_token_s: float) -> Speculator:
    speculator = Speculator(SpeculativeConfig(**ADAPTIVE), max_model_len=1024)
    for _ in range(20):
        for n in (8, 16, 24, 40):
            speculator.step_cost.record(n, fixed_s + per_token_s * n)
    return speculator


def _verifying(num_seqs: int) -> list[ScheduledSequence]:
    items = []
    for i in range(num_seqs):
        group = SequenceGroup.from_prompt(f"r{i}", PROMPT, LONG, seq_id=i, arrival_time=0.0)
        items.append(ScheduledSequence(group, group.seqs[0], 5, 1, True, [1, 2, 3, 4]))
    return items


def test_each_sequence_keeps_drafts_by_its_own_acceptance():
    """A compute-bound step at batch 8 (a token costs a quarter of the fixed part): the four
    sequences whose drafts were all kept verify all four again, the four whose drafts were all
    rejected verify none, whatever the engine's rate over all of them."""
    speculator = _speculator_with_cost(0.040, 0.010)
    items = _verifying(8)
    for _ in range(6):
        for item in items:
            speculator.record(item.seq, 4, 4 if item.seq.seq_id < 4 else 0)
    assert speculator.drafts_that_pay(items) == [4] * 4 + [0] * 4



DRAFT_MODEL = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 4}


def _draft_model_speculator(draft_position_s: float) -> Speculator:
    """A 7 ms target step at batch 1; the draft model's positions timed by the worker."""
    speculator = Speculator(SpeculativeConfig(**DRAFT_MODEL), max_model_len=1024)
    for _ in range(20):
        speculator.step_cost.record(1, 0.007)
    items = _proposing(1)
    speculator.record_step(items, StepTimings(forward_ns=7_000_000,
                                              draft_ns=round(4 * draft_position_s * 1e9)))
    return speculator


def _proposing(num_seqs: int) -> list[ScheduledSequence]:
    items = _verifying(num_seqs)
    for item in items:
        item.draft_token_ids = [PLACEHOLDER_TOKEN_ID] * 4
    return items


def _decoding_alone(num_seqs: int) -> list[ScheduledSequence]:
    items = _verifying(num_seqs)
    for item in items:
        item.num_scheduled_tokens, item.draft_token_ids = 1, None
    return items


def test_a_draft_model_whose_positions_cost_more_than_they_save_speculates_not_and_runs_ahead():
    speculator = _draft_model_speculator(draft_position_s=0.008)
    assert speculator.drafts_that_pay(_proposing(1)) == [0]
    assert not speculator.holds_back_run_ahead(_decoding_alone(1), num_running=1)


def test_a_cheap_draft_model_proposes_every_position_and_holds_run_ahead_back():
    speculator = _draft_model_speculator(draft_position_s=0.0005)
    assert speculator.drafts_that_pay(_proposing(1)) == [4]
    assert speculator.holds_back_run_ahead(_decoding_alone(1), num_running=1)


def _with_low_acceptance(speculator: Speculator) -> Speculator:
    """The engine's drafts so far were rejected: the prior any sequence starts from is ~1%."""
    for i in range(400):
        group = SequenceGroup.from_prompt(f"x{i}", PROMPT, LONG, seq_id=1000 + i,
                                          arrival_time=0.0)
        speculator.record(group.seqs[0], 4, 0)
    return speculator


def _owing(prompt_lens: list[int]) -> list[ScheduledSequence]:
    """Decoding sequences that have not proposed yet: the draft model owes their prompts."""
    items = []
    for i, prompt_len in enumerate(prompt_lens):
        group = SequenceGroup.from_prompt(f"r{i}", list(range(1, prompt_len + 1)), LONG,
                                          seq_id=i, arrival_time=0.0)
        group.seqs[0].append_token(7, -0.5)
        items.append(ScheduledSequence(group, group.seqs[0], 5, 1, True,
                                       [PLACEHOLDER_TOKEN_ID] * 4))
    return items


def test_speculation_turned_off_is_tried_again_with_one_draft_each():
    """Drafts rarely kept: the choice turns speculation off, and tries it again after 16
    steps, since the acceptance it learned may be stale."""
    speculator = _with_low_acceptance(_draft_model_speculator(draft_position_s=0.002))
    held = [speculator.holds_back_run_ahead(_decoding_alone(2), num_running=2)
            for _ in range(16)]
    assert held == [False] * 15 + [True]  # the step after the 16th waits, to draft
    items = _owing([4, 4])
    assert speculator.drafts_that_pay(items) == [1, 1]
    assert speculator.drafts_that_pay(items) == [0, 0]


def test_no_trial_where_its_drafts_would_not_pay_if_all_were_kept():
    """Each draft position costs more than the step: no acceptance the trial could learn
    turns speculation on, so no step is held back for it."""
    speculator = _draft_model_speculator(draft_position_s=0.008)
    held = [speculator.holds_back_run_ahead(_decoding_alone(2), num_running=2)
            for _ in range(64)]
    assert held == [False] * 64


def test_a_draft_models_drafts_cut_by_the_choice_are_not_misses():
    speculator = _draft_model_speculator(draft_position_s=0.008)
    item = _decoding_alone(1)[0]
    for _ in range(40):
        speculator.record(item.seq, 0, 0)
    assert speculator.is_speculating(item.group, item.seq)


def test_ngram_drafts_are_chosen_as_before_whatever_the_host_takes():
    """n-gram lookup's steps sent behind still draft: the host's time per step, which a draft
    model's choice weighs, leaves its choice alone; its positions cost nothing."""
    speculator = _speculator_with_cost(0.100, 0.001)  # memory-bound: every draft pays
    items = _verifying(8)
    for _ in range(5):
        speculator.record_step(_decoding_alone(8), StepTimings(forward_ns=100_000_000),
                               host_s=1.0)
    assert speculator.drafts_that_pay(items) == [4] * 8
    assert speculator.draft_cost.line() == (0.0, 0.0)


def test_a_draft_models_first_drafts_are_one_each_until_its_cost_is_timed():
    speculator = Speculator(SpeculativeConfig(**DRAFT_MODEL), max_model_len=1024)
    for _ in range(20):
        speculator.step_cost.record(1, 0.007)
    items = _owing([4, 4])
    assert speculator.drafts_that_pay(items) == [1, 1]
    speculator.record_step(items, StepTimings(forward_ns=7_000_000, draft_ns=2_000_000))
    assert speculator.drafts_that_pay(items) == [4, 4]


def test_drafts_that_a_step_catch_up_does_not_reach_are_not_verified():
    """Drafts would pay for every sequence of the batch, but the draft model owes each its
    600-token prompt and catches up at most 2048 tokens a step: the three it reaches draft,
    the others would propose nothing while the step holds run-ahead back for them."""
    speculator = _draft_model_speculator(draft_position_s=0.0005)
    items = _owing([600] * 8)
    assert speculator.drafts_that_pay(items) == [4] * 3 + [0] * 5
    for item in items[:3]:
        speculator.record(item.seq, 4, 4)
    assert speculator.drafts_that_pay(items) == [4] * 6 + [0] * 2  # the next three


def test_a_lone_sequence_behind_by_more_than_a_step_catches_up_to_draft():
    speculator = _draft_model_speculator(draft_position_s=0.0005)
    assert speculator.drafts_that_pay(_owing([5000])) == [4]


def test_a_trial_drafts_where_it_owes_the_least_catch_up():
    """A batch of 32 behind after speculation was off: the trial drafts for the least behind
    sequence alone, not a catch-up chunk of the whole batch; where some owe nothing, for
    those."""
    speculator = _with_low_acceptance(_draft_model_speculator(draft_position_s=0.00015))
    for _ in range(16):
        speculator.holds_back_run_ahead(_decoding_alone(32), num_running=32)
    assert speculator.drafts_that_pay(_owing([521] * 5 + [520] + [521] * 26)) == (
        [0] * 5 + [1] + [0] * 26)
    for _ in range(32):
        speculator.holds_back_run_ahead(_decoding_alone(32), num_running=32)
    assert speculator.drafts_that_pay(_owing([520] * 7 + [4, 4] + [520] * 23)) == (
        [0] * 7 + [1, 1] + [0] * 23)


def test_a_preempted_sequence_owes_its_draft_kv_again():
    """A recompute starts the draft model's KV over: the sequence is counted behind again."""
    speculator = _draft_model_speculator(draft_position_s=0.0005)
    items = _owing([600] * 8)
    for item in items[:3]:
        speculator.record(item.seq, 4, 4)
    speculator.preempted(items[0].seq)
    assert speculator.drafts_that_pay(items) == [4] * 5 + [0] * 3
