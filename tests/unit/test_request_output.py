"""make_request_output on hand-built groups: what a report carries, and when there is none."""

from __future__ import annotations

import pytest
from pagedserve.scheduler_svc.outputs import make_request_output
from pagedserve.scheduler_svc.sequence import SequenceGroup
from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.sampling_params import SamplingParams


def test_a_stream_reports_each_token_once_and_its_finish_once():
    group = SequenceGroup.from_prompt("r", [1, 2, 3], SamplingParams(max_tokens=8), 0)
    seq = group.seqs[0]
    seq.append_token(5, -0.5)
    seq.append_token(6, -0.25)
    seq.add_placeholder()  # a step in flight: its token is not reported
    first = make_request_output(group)
    assert not first.finished and first.num_prompt_tokens == 3
    [delta] = first.outputs
    assert (delta.token_ids, delta.logprobs, delta.finish_reason) == ([5, 6], [-0.5, -0.25], None)
    assert make_request_output(group) is None  # nothing new
    seq.drop_placeholder()
    seq.append_token(7, -1.0)
    seq.finish(FinishReason.STOP)
    [delta] = make_request_output(group).outputs
    assert delta.token_ids == [7] and delta.finish_reason == FinishReason.STOP
    assert delta.cumulative_logprob == -1.75
    assert make_request_output(group) is None


def test_a_stream_finished_with_nothing_new_reports_the_finish_alone():
    group = SequenceGroup.from_prompt("r", [1, 2], SamplingParams(max_tokens=8), 0)
    group.seqs[0].append_token(5, -0.5)
    make_request_output(group)
    group.finish(FinishReason.ABORT)
    report = make_request_output(group)
    assert report.finished
    [delta] = report.outputs
    assert delta.token_ids == [] and delta.finish_reason == FinishReason.ABORT
    assert make_request_output(group) is None


@pytest.mark.parametrize("sampling, is_streamed", [
    (SamplingParams(n=2), True),
    (SamplingParams(n=2, best_of=2), True),
    (SamplingParams(n=1, best_of=3), False),
    (SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0.0), False),
])
def test_only_plain_requests_report_before_their_end(sampling, is_streamed):
    group = SequenceGroup.from_prompt("r", [1, 2], sampling, 0)
    group.seqs[0].append_token(5, -0.5)
    assert group.is_streamed is is_streamed
    report = make_request_output(group)
    assert (report is not None) is is_streamed
    group.finish(FinishReason.LENGTH)
    [delta] = make_request_output(group).outputs
    assert delta.token_ids == ([] if is_streamed else [5])
    assert delta.finish_reason == FinishReason.LENGTH


def test_the_first_report_of_a_group_finished_unscheduled_carries_its_prompt_logprobs():
    group = SequenceGroup.from_prompt("r", [1, 2, 3], SamplingParams(prompt_logprobs=1), 0)
    group.finish(FinishReason.ERROR, "too long")
    report = make_request_output(group)
    assert report.finished and report.prompt_logprobs == []
    [delta] = report.outputs
    assert delta.finish_reason == FinishReason.ERROR and delta.error == "too long"
