"""The scheduler's side of draft-model speculation: it plans lookahead slots the worker's draft
model fills (their number on the wire, no token ids), counts and gives back their slots as it
does n-gram drafts; and the config names the draft model."""

from __future__ import annotations

import json

import pytest
from pagedserve.services.common.config import SchedulerConfig
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.common.step_plan import SampledSequence, StepOutput

from tests.unit.test_draft_proposer import VOCAB
from tests.unit.test_spec_decode_scheduler import PROMPT, SpecHarness

DRAFT_MODEL = json.dumps({"method": "draft_model", "model": "/models/draft",
                          "num_speculative_tokens": 4, "adaptive": False})


class DraftModelHarness(SpecHarness):
    """A worker whose draft model's first `num_kept` drafts are right."""

    num_kept = 2

    def sample(self, out, logprobs=None, tokens=None) -> StepOutput:
        samples = []
        for item in out.scheduled:
            if item.is_sampling:
                num_tokens = 1 + min(self.num_kept, len(item.draft_token_ids or ()))
                ids = [(len(item.seq.token_ids) + i) % VOCAB for i in range(num_tokens)]
                samples.append(SampledSequence(item.seq.seq_id, ids, [-0.5] * num_tokens))
        return StepOutput(out.plan.step_id, samples)


def test_the_plan_carries_lookahead_slots_and_kept_drafts_are_computed():
    h = DraftModelHarness(accept=len, speculative_config=DRAFT_MODEL)
    h.add_prompt("r", PROMPT)
    out, _ = h.step()
    assert out.plan.new_seqs[0].num_lookahead_slots == 0  # a prompt is not speculated on
    out, _ = h.step()
    delta, = out.plan.running_seqs
    assert (delta.num_lookahead_slots, delta.draft_token_ids) == (4, [])
    assert delta.num_scheduled_tokens == 5 and not out.may_run_ahead
    item, = out.scheduled
    seq = item.seq
    # 12 prompt tokens + 1 sampled, then 2 kept drafts and the next token
    assert len(seq.token_ids) == 16 and seq.num_computed_tokens == 15
    assert h.scheduler.block_manager.num_tokens(seq.seq_id) == 15  # the rejected slots went back
    totals = h.scheduler.speculator.totals
    assert (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) == (1, 4, 2)


class BehindHarness(DraftModelHarness):
    """A worker whose draft model is catching up: it proposes nothing for the slots."""

    def sample(self, out, logprobs=None, tokens=None) -> StepOutput:
        return StepOutput(out.plan.step_id, [
            SampledSequence(item.seq.seq_id, [len(item.seq.token_ids) % VOCAB], [-0.5],
                            is_draft_behind=bool(item.draft_token_ids))
            for item in out.scheduled if item.is_sampling])


def test_a_sequence_whose_draft_model_is_behind_counts_no_draft_and_gives_its_slots_back():
    h = BehindHarness(accept=len, speculative_config=DRAFT_MODEL)
    h.add_prompt("r", PROMPT)
    h.step()
    out, _ = h.step()
    assert out.plan.running_seqs[0].num_lookahead_slots == 4
    seq = out.scheduled[0].seq
    assert len(seq.token_ids) == 14 and seq.num_computed_tokens == 13
    assert h.scheduler.block_manager.num_tokens(seq.seq_id) == 13
    totals = h.scheduler.speculator.totals
    assert (totals.num_drafts, totals.num_draft_tokens, totals.num_accepted_tokens) == (0, 0, 0)
    out, _ = h.step()  # not backed off: it is offered slots again
    assert out.plan.running_seqs[0].num_lookahead_slots == 4


@pytest.mark.parametrize(("value", "match"), [
    ('{"method": "draft_model"}', "speculative_config.model names the draft model"),
    ('{"method": "ngram", "model": "/models/draft"}', "model='/models/draft'"),
    ('{"method": "eagle", "model": "/models/draft"}', "method must be one of"),
])
def test_the_draft_model_is_named_with_its_method_only(value, match):
    with pytest.raises(ConfigError, match=match):
        SchedulerConfig(speculative_config=value)
