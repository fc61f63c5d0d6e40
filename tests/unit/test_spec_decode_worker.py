"""The worker's mirror of a verified step: drafts in the inputs and the logits rows, the kept
tokens appended, bad drafts refused; and the drafts on the wire."""

from __future__ import annotations

import pytest
import torch
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import (
    NewSequence,
    RunningSequence,
    SampledSequence,
    StepPlan,
)
from pagedserve.services.rpc.convert_worker import step_plan_from_proto, step_plan_to_proto
from pagedserve.worker_svc.model_input import build_model_input
from pagedserve.worker_svc.sequence_mirrors import SequenceMirrors

GREEDY = SamplingParams(temperature=0.0)
CPU = torch.device("cpu")


def new_plan(step_id: int, **seq) -> StepPlan:
    fields = dict(seq_id=1, request_id="r", token_ids=[5, 6, 7, 8, 9], prompt_len=5,
                  block_ids=[0, 1], num_computed_tokens=0, num_scheduled_tokens=5,
                  sampling=GREEDY)
    fields.update(seq)
    return StepPlan(scheduler_epoch=1, step_id=step_id, new_seqs=[NewSequence(**fields)])


def test_a_verified_step_feeds_the_drafts_and_appends_what_was_kept():
    mirrors = SequenceMirrors(block_size=4, max_model_len=64)
    seq, = mirrors.apply(new_plan(1))
    mirrors.mark_computed([seq])
    mirrors.append_drawn([seq], [SampledSequence(1, [10], [0.0])])
    plan = StepPlan(scheduler_epoch=1, step_id=2, previous_step_id=1, running_seqs=[
        RunningSequence(seq_id=1, new_token_ids=[], block_ids_start=2, block_ids=[2],
                        num_scheduled_tokens=4, draft_token_ids=[11, 12, 13])])
    mirrors.check(plan)
    seq, = mirrors.apply(plan)
    model_input = build_model_input([seq], 4, CPU)
    assert model_input.input_ids.tolist() == [10, 11, 12, 13]
    assert model_input.positions.tolist() == [5, 6, 7, 8]
    assert model_input.logits_indices.tolist() == [0, 1, 2, 3]  # a row per draft, and one more
    mirrors.mark_computed([seq])
    assert seq.num_computed_tokens == 6 and not mirrors.drawing
    mirrors.append_drawn([seq], [SampledSequence(1, [11, 20], [0.0, 0.0])])
    assert seq.token_ids == [5, 6, 7, 8, 9, 10, 11, 20]
    assert seq.num_computed_tokens == 7 and seq.draft_token_ids == []


@pytest.mark.parametrize(("seq", "match"), [
    (dict(token_ids=[5, 6, 7], num_scheduled_tokens=5, draft_token_ids=[1, 99]), "draft_token_ids"),
    (dict(token_ids=[5, 6, 7], num_scheduled_tokens=4, draft_token_ids=[1, 2]), "must end"),
    (dict(token_ids=[5, 6, 7], num_scheduled_tokens=5, draft_token_ids=[1, 2], num_samples=2,
          sampling=SamplingParams(n=2, temperature=1.0)), "num_samples=1"),
])
def test_drafts_that_cannot_be_verified_are_refused(seq, match):
    with pytest.raises(InvalidRequest, match=match):
        SequenceMirrors(block_size=4, max_model_len=64).check(new_plan(1, **seq), 8, 50)


def test_drafts_cross_the_wire():
    plan = new_plan(1, token_ids=[5, 6, 7], num_scheduled_tokens=5, draft_token_ids=[1, 2])
    plan = StepPlan(**{**{f: getattr(plan, f) for f in plan.__slots__}, "running_seqs": [
        RunningSequence(seq_id=2, new_token_ids=[], block_ids_start=1, block_ids=[],
                        num_scheduled_tokens=3, draft_token_ids=[4, 4])]})
    back = step_plan_from_proto(step_plan_to_proto(plan))
    assert back.new_seqs[0].draft_token_ids == [1, 2]
    assert back.running_seqs[0].draft_token_ids == [4, 4]
