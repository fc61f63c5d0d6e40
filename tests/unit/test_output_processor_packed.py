"""Packed single samples (sampled_seq_ids, sampled_token_ids, sampled_logprobs, as the worker and
the wire return them) give the scheduler what the same samples as SampledSequences give, without
building a SampledSequence each."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from pagedserve.scheduler_svc import output_processor
from pagedserve.scheduler_svc.step_window import SentStep
from pagedserve.services.common import step_plan
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import SampledSequence, StepOutput, TokenIdLogprob

from tests.unit.test_scheduler import EOS, Harness
from tests.unit.test_spec_decode_scheduler import PROMPT, SpecHarness

STOP = 7


def _packed(output: StepOutput) -> StepOutput:
    """The single samples moved to the packed lists, as step_output_to_proto packs them."""
    single = [s for s in output.outputs if len(s.token_ids) == 1 and not s.top_logprobs
              and not s.prompt_logprobs and not s.is_draft_behind]
    return dataclasses.replace(
        output, outputs=[s for s in output.outputs if s not in single],
        sampled_seq_ids=[s.seq_id for s in single],
        sampled_token_ids=[s.token_ids[0] for s in single],
        sampled_logprobs=[s.logprobs[0] for s in single])


@pytest.fixture
def num_built(monkeypatch) -> list[int]:
    """Counts the SampledSequences that step_plan and the output processor build."""
    built = [0]

    def counting(*args, **kwargs):
        built[0] += 1
        return SampledSequence(*args, **kwargs)

    monkeypatch.setattr(step_plan, "SampledSequence", counting)
    monkeypatch.setattr(output_processor, "SampledSequence", counting)
    return built


def _script(seq_id: int, num_output_tokens: int) -> int:
    """EOS at output positions 2 and 5, the stop token at 3, distinct tokens elsewhere."""
    return {2: EOS, 5: EOS, 3: STOP}.get(num_output_tokens, 20 + 10 * seq_id + num_output_tokens)


def _run_stops(is_packed: bool) -> tuple[list, dict]:
    h = Harness()
    h.add("eos", 4, SamplingParams(temperature=0.0, max_tokens=10))
    h.add("min_tokens", 4, SamplingParams(temperature=0.0, max_tokens=10, min_tokens=4))
    h.add("stop", 4, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True,
                                    stop_token_ids=[STOP]))
    h.add("length", 4, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True))
    h.add("n2", 4, SamplingParams(n=2, temperature=1.0, max_tokens=4, ignore_eos=True, seed=1))
    h.add("logprobs", 4, SamplingParams(temperature=0.0, max_tokens=3, logprobs=1,
                                        ignore_eos=True))
    reports = []
    while h.scheduler.has_unfinished():
        out = h.scheduler.schedule()
        samples = []
        for item in out.scheduled:
            if not item.is_sampling:
                continue
            seq = item.seq
            ids = [_script(seq.seq_id, seq.num_output_tokens + i) for i in range(item.num_samples)]
            top = [[TokenIdLogprob(t, -0.25)] for t in ids] if item.group.sampling.logprobs else []
            samples.append(SampledSequence(seq.seq_id, ids, [-0.5] * len(ids), top))
        output = StepOutput(out.plan.step_id, samples)
        reports += h.processor.report(h.take_in(SentStep(out, []),
                                                _packed(output) if is_packed else output))
    seqs = {rid: [(s.token_ids, s.output_logprobs, s.cumulative_logprob, s.status)
                  for s in g.seqs] for rid, g in h.groups.items()}
    assert h.all_free()
    return reports, seqs


def test_packed_single_samples_stop_and_fork_as_sampled_sequences_do(num_built):
    num_built[0] = 0
    packed = _run_stops(is_packed=True)
    num_packed_built = num_built[0]
    num_built[0] = 0
    assert _run_stops(is_packed=False) == packed
    assert num_packed_built == 0
    finished = {r.request_id: [o.finish_reason for o in r.outputs] for r in packed[0]
                if r.finished}
    assert finished == {"eos": ["stop"], "min_tokens": ["stop"], "stop": ["stop"],
                        "length": ["length"], "n2": ["length", "length"],
                        "logprobs": ["length"]}


def _run_spec(is_packed: bool, accepted: list[int]) -> tuple[list, list, object]:
    """An n-gram request whose verifications accept `accepted[i]` drafts in turn."""
    turns = itertools.cycle(accepted)
    h = SpecHarness(accept=lambda drafts: min(next(turns), len(drafts)))
    group = h.add_prompt("r", PROMPT)
    steps = []
    while h.scheduler.has_unfinished():
        out = h.scheduler.schedule()
        output = h.sample(out)
        steps.append([(i.draft_token_ids, i.num_scheduled_tokens) for i in out.scheduled])
        h.take_in(SentStep(out, []), _packed(output) if is_packed else output)
        steps.append([(s.token_ids[:], s.num_computed_tokens, h.bm.block_table(s.seq_id)[:])
                      for s in group.seqs if not s.is_finished])
    assert h.all_free()
    return steps, group.seqs[0].token_ids, dataclasses.asdict(h.scheduler.speculator.totals)


@pytest.mark.parametrize("accepted", [[0], [0, 2, 0, 4, 1]])
def test_a_packed_verification_that_accepted_no_draft_gives_its_slots_back(num_built, accepted):
    """Over the wire a verification that accepted none of its drafts is a single sample: the
    drafts it carried (the scheduled step's, not the sample's) count it as verified."""
    packed = _run_spec(True, accepted)
    assert packed[2]["num_drafts"] > 0
    assert _run_spec(False, accepted) == packed


def test_a_packed_step_builds_no_sampled_sequence(num_built):
    h = Harness()
    for i in range(4):
        h.add(f"r{i}", 4, SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    h.step()  # the prompts
    out = h.scheduler.schedule()
    seq_ids = [item.seq.seq_id for item in out.scheduled]
    num_built[0] = 0
    groups = h.take_in(SentStep(out, []), StepOutput(
        out.plan.step_id, sampled_seq_ids=seq_ids, sampled_token_ids=[50 + s for s in seq_ids],
        sampled_logprobs=[-1.0] * len(seq_ids)))
    assert num_built[0] == 0
    assert [g.seqs[0].output_token_ids[-1] for g in groups] == [50 + s for s in seq_ids]


def test_packed_lists_of_unequal_lengths_are_refused():
    with pytest.raises(ValueError, match="equal lengths, got 2, 1 and 2"):
        StepOutput(0, sampled_seq_ids=[1, 2], sampled_token_ids=[3],
                   sampled_logprobs=[0.0, 0.0]).packed_indices()
