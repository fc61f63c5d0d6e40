"""Finish conditions, streaming deltas, n / best_of and beam search, with hand-built samples."""

from __future__ import annotations

import pytest
from pagedserve.scheduler_svc.sequence import derive_seed
from pagedserve.services.common.sampling_params import SamplingParams

from tests.unit.test_scheduler import EOS, Harness


def run(h: Harness, request_id: str, prompt_len: int, sampling: SamplingParams, tokens: list[int]):
    """Feed `tokens` one per step to a single-sequence request; returns its reports."""
    group = h.add(request_id, prompt_len, sampling)
    reports = []
    for token in tokens:
        if group.is_finished:
            break
        reports += h.step(tokens={group.seqs[0].seq_id: [token]})[1]
    return group, reports


@pytest.mark.parametrize("sampling, tokens, expected_len, reason", [
    (SamplingParams(max_tokens=8), [5, 6, EOS, 7], 3, "stop"),  # EOS included, then stop
    (SamplingParams(max_tokens=5, ignore_eos=True), [5, EOS, 6, 7, 8, 9], 5, "length"),
    (SamplingParams(max_tokens=8, min_tokens=2), [EOS, EOS, EOS, 5], 3, "stop"),
    (SamplingParams(max_tokens=8, stop_token_ids=[7]), [5, 7, 6], 2, "stop"),
    (SamplingParams(max_tokens=3), [5, 6, 7, 8], 3, "length"),
])
def test_finish_conditions(sampling, tokens, expected_len, reason):
    h = Harness()
    group, reports = run(h, "r", 4, sampling, tokens)
    seq = group.seqs[0]
    assert seq.output_token_ids == tokens[:expected_len]
    assert seq.finish_reason == reason and reports[-1].finished
    assert h.all_free()


def test_max_model_len_ends_generation():
    h = Harness(max_model_len=8)
    group, reports = run(h, "r", 5, SamplingParams(max_tokens=50, ignore_eos=True), [5] * 10)
    assert len(group.seqs[0].token_ids) == 8
    assert reports[-1].outputs[0].finish_reason == "length"


def test_streaming_reports_carry_only_new_tokens():
    h = Harness()
    _, reports = run(h, "r", 4, SamplingParams(max_tokens=3, ignore_eos=True,
                                              prompt_logprobs=0), [5, 6, 7])
    assert [r.outputs[0].token_ids for r in reports] == [[5], [6], [7]]
    assert [r.finished for r in reports] == [False, False, True]
    assert [r.outputs[0].finish_reason for r in reports] == [None, None, "length"]
    assert reports[0].prompt_logprobs is not None and reports[1].prompt_logprobs is None
    assert reports[2].outputs[0].cumulative_logprob == pytest.approx(-0.3)


def test_best_of_reports_the_n_best_once_at_the_end():
    h = Harness()
    sampling = SamplingParams(n=2, best_of=4, max_tokens=2, ignore_eos=True)
    group = h.add("r", 4, sampling)
    out, reports = h.step(logprobs={group.seqs[0].seq_id: [-3.0, -1.0, -2.0, -4.0]})
    assert out.scheduled[0].num_samples == 4 and len(group.seqs) == 4 and not reports
    seeds = {s.seed for s in group.seqs}
    assert len(seeds) == 1 and None in seeds  # unseeded
    reports = h.run_to_end()
    final, = reports
    assert final.finished and [o.index for o in final.outputs] == [0, 1]
    # second-step logprobs are all -0.1: the first-step ranking decides
    assert [o.cumulative_logprob for o in final.outputs] == pytest.approx([-1.1, -2.1])
    assert all(len(o.token_ids) == 2 for o in final.outputs)
    assert h.all_free()


def test_seeded_group_gets_distinct_stable_seeds():
    h = Harness()
    group = h.add("r", 4, SamplingParams(n=3, seed=7, max_tokens=2, ignore_eos=True))
    h.step()
    assert [s.seed for s in group.seqs] == [derive_seed(7, i) for i in range(3)]
    assert len({s.seed for s in group.seqs}) == 3
    assert derive_seed(7, 1) == derive_seed(7, 1) != derive_seed(8, 1)


def test_beam_search_keeps_the_best_continuations_and_stops_like_hf():
    h = Harness()
    sampling = SamplingParams(n=1, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=8)
    group = h.add("beam", 4, sampling)
    root = group.seqs[0]
    # step 1: one beam, 4 candidates; EOS ranks third (not among the best 2): dropped
    out, _ = h.step(tokens={root.seq_id: [10, 11, EOS, 12]},
                    logprobs={root.seq_id: [-0.1, -0.2, -0.3, -1.0]})
    assert out.scheduled[0].num_samples == 4
    a, b = group.seqs
    assert (a.output_token_ids, b.output_token_ids) == ([10], [11]) and not group.beam_hypotheses
    # step 2: a's EOS is the best candidate (finished: score -0.15 / 2); b's two continuations win
    out, _ = h.step(tokens={a.seq_id: [EOS, 20, 21, 22], b.seq_id: [30, 31, 32, 33]},
                    logprobs={a.seq_id: [-0.05, -1.0, -2.0, -3.0],
                              b.seq_id: [-0.1, -0.5, -2.5, -3.5]})
    assert [h.token_ids for h in group.beam_hypotheses] == [[10, EOS]]
    assert group.beam_hypotheses[0].score == pytest.approx(-0.15 / 2)
    assert a.is_finished and not h.bm.has_seq(a.seq_id)  # no continuation: freed
    b1, b2 = group.seqs
    assert b1 is b and b1.output_token_ids == [11, 30] and b2.output_token_ids == [11, 31]
    # step 3: the fork reaches the worker whole
    out, reports = h.step(tokens={b1.seq_id: [EOS, 41, 42, 43], b2.seq_id: [40, 44, 45, 46]},
                    logprobs={b1.seq_id: [-0.1, -3.0, -3.1, -3.2],
                              b2.seq_id: [-0.01, -4.0, -4.1, -4.2]})
    assert b2.seq_id in {s.seq_id for s in out.plan.new_seqs}
    assert out.plan.finished_seq_ids == [a.seq_id]
    # two hypotheses now; the best live beam (-0.71 / 3) cannot beat the worst (-0.4 / 3): done
    assert group.is_finished and not h.scheduler.has_unfinished()
    final, = reports
    assert final.finished and [o.token_ids for o in final.outputs] == [[10, EOS]]
    assert final.outputs[0].finish_reason == "stop"
    assert h.all_free()


def test_beam_search_final_output_is_the_best_hypothesis():
    h = Harness()
    sampling = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=2,
                              ignore_eos=True)
    group = h.add("beam", 4, sampling)
    root = group.seqs[0]
    h.step(tokens={root.seq_id: [10, 11, 12, 13]}, logprobs={root.seq_id: [-1, -2, -3, -4]})
    a, b = group.seqs
    _, reports = h.step(tokens={a.seq_id: [20, 21, 22, 23], b.seq_id: [30, 31, 32, 33]},
                        logprobs={a.seq_id: [-5.0, -6.0, -7, -8], b.seq_id: [-0.5, -0.6, -9, -9]})
    final, = reports
    assert final.finished
    # max_tokens reached: the best 2 candidates become hypotheses, scored by mean logprob
    assert [o.token_ids for o in final.outputs] == [[11, 30], [11, 31]]
    assert [o.finish_reason for o in final.outputs] == ["length", "length"]
    assert h.all_free()


def test_masked_beam_candidates_never_continue_and_fewer_completions_give_fewer_outputs():
    """Structured outputs mask tokens (-inf logprob) before the beams draw their candidates: a
    grammar that allows one token per step keeps one beam, and the request reports the one
    completion there is, not n."""
    inf = float("-inf")
    h = Harness()
    sampling = SamplingParams(n=2, best_of=2, use_beam_search=True, temperature=0.0, max_tokens=8)
    group = h.add("beam", 4, sampling)
    root = group.seqs[0]
    h.step(tokens={root.seq_id: [10, 11, 12, 13]}, logprobs={root.seq_id: [-0.5, inf, inf, inf]})
    assert [s.output_token_ids for s in group.seqs] == [[10]]
    _, reports = h.step(tokens={root.seq_id: [EOS, 11, 12, 13]},
                        logprobs={root.seq_id: [-0.1, inf, inf, inf]})
    final, = reports
    assert final.finished and [o.token_ids for o in final.outputs] == [[10, EOS]]
    assert h.all_free()


def test_a_malformed_worker_answer_fails_only_its_request():
    h = Harness(enable_prefix_caching=True)
    pair = h.add("pair", 9, SamplingParams(n=2, temperature=1.0, max_tokens=3, ignore_eos=True))
    other = h.add("other", 9)
    h.step()
    first, second = pair.seqs
    # two tokens for a sequence that asked for one
    _, reports = h.step(tokens={first.seq_id: [5, 6]})
    failed = next(r for r in reports if r.request_id == "pair")
    assert failed.finished and {o.finish_reason for o in failed.outputs} == {"error"}
    assert "expected 1" in failed.outputs[0].error
    h.run_to_end()
    assert other.seqs[0].finish_reason == "length" and h.all_free()
