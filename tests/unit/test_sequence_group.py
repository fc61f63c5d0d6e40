"""SequenceGroup's per-step predicates, which read sequence statuses inline (the scheduler asks
them of every running group several times a step)."""

from pagedserve.scheduler_svc.sequence import SequenceGroup, SequenceStatus
from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.sampling_params import SamplingParams


def _group_of_two() -> SequenceGroup:
    group = SequenceGroup.from_prompt("r", [1, 2, 3], SamplingParams(n=2, max_tokens=8), 0)
    group.seqs.append(group.seqs[0].fork(1, 1, None))
    for seq in group.seqs:
        seq.status = SequenceStatus.RUNNING
    return group


def test_a_finished_sequence_is_not_live_and_does_not_hold_its_group_in_prefill():
    group = _group_of_two()
    decoding, stopped = group.seqs
    decoding.num_computed_tokens = 3
    decoding.append_token(7, -0.5)
    assert not group.is_decode_phase()  # the other still has its whole prompt to compute
    stopped.finish(FinishReason.STOP)
    assert group.live_seqs() == [decoding]
    assert group.is_decode_phase()
    assert stopped.is_finished and not group.is_finished


def test_a_group_is_finished_once_every_sequence_is():
    group = _group_of_two()
    group.seqs[0].finish(FinishReason.LENGTH)
    assert not group.is_finished
    group.seqs[1].finish(FinishReason.ABORT)
    assert group.is_finished and group.live_seqs() == []
    assert [s.finish_reason for s in group.seqs] == [FinishReason.LENGTH, FinishReason.ABORT]
