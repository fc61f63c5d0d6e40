"""A request resumed with the outputs it already streamed (a gateway's failover) continues
exactly as the uninterrupted run: same tokens for greedy and seeded sampling, n > 1 included."""

from __future__ import annotations

import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams

from tests.integration.test_engine import all_outputs, assert_all_blocks_free, make_engine, prompts
from tests.integration.test_spec_decode import prompts_with_repeats


def resumed_outputs(engine, prompt: list[int], sampling: SamplingParams,
                    resumed: dict[int, list[int]]) -> dict[int, list[int]]:
    engine.core.add_request("r", prompt, sampling, resumed=resumed)
    tokens = {index: list(ids) for index, ids in resumed.items()}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for report in engine.step():
            for out in report.outputs:
                tokens[out.index].extend(out.token_ids)
    assert not engine.has_unfinished_requests()
    return tokens


@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=11, max_tokens=16, ignore_eos=True,
                   repetition_penalty=1.3, min_tokens=10),
    SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True),
], ids=["greedy", "seeded_penalized", "seeded_n2"])
def test_a_resumed_request_continues_token_identically(llama_dir, sampling):
    prompt = prompts(7, [13])[0]
    expected = all_outputs(make_engine(llama_dir), [prompt], sampling)["r0"]
    engine = make_engine(llama_dir)
    for cut in (1, 7):
        resumed = {i: out[:cut] for i, out in enumerate(expected)}
        got = resumed_outputs(engine, prompt, sampling, resumed)
        assert [got[i] for i in range(len(expected))] == expected
    assert_all_blocks_free(engine)


def test_only_the_resumed_indices_run(llama_dir):
    sampling = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    prompt = prompts(8, [9])[0]
    expected = all_outputs(make_engine(llama_dir), [prompt], sampling)["r0"]
    got = resumed_outputs(make_engine(llama_dir), prompt, sampling, {1: expected[1][:4]})
    assert got == {1: expected[1]}


@pytest.mark.parametrize("adaptive", [False, True], ids=["every_lookup", "adaptive"])
@pytest.mark.parametrize("sampling", [
    SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
    SamplingParams(temperature=1.0, seed=3, max_tokens=24, ignore_eos=True),
], ids=["greedy", "seeded"])
def test_a_request_resumed_with_speculation_continues_as_the_run_without_it(llama_dir, sampling,
                                                                            adaptive):
    prompt = prompts_with_repeats(1)[0]
    expected = all_outputs(make_engine(llama_dir), [prompt], sampling)["r0"]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "adaptive": adaptive}
    engine = make_engine(llama_dir, speculative_config=spec)
    for cut in (1, 9):
        got = resumed_outputs(engine, prompt, sampling, {0: expected[0][:cut]})
        assert got[0] == expected[0]
    assert engine.core.scheduler.speculator.totals.num_draft_tokens > 0
    assert_all_blocks_free(engine)


@pytest.mark.parametrize(("sampling", "resumed", "match"), [
    (SamplingParams(n=2, best_of=3, max_tokens=8), {0: [5]}, "best_of=3"),
    (SamplingParams(max_tokens=4), {1: [5]}, r"index must be in \[0, n=1\)"),
    (SamplingParams(max_tokens=4), {0: []}, "has no token_ids"),
    (SamplingParams(max_tokens=4), {0: [5, 6, 7, 8]}, "max_tokens=4"),
    (SamplingParams(max_tokens=4), {0: [9999]}, "vocab_size"),
], ids=["best_of", "index", "empty", "max_tokens", "vocab"])
def test_bad_resumed_outputs_are_refused(llama_dir, sampling, resumed, match):
    engine = make_engine(llama_dir)
    with pytest.raises(InvalidRequest, match=match):
        engine.core.add_request("r", [5, 6, 7], sampling, resumed=resumed)
    assert not engine.has_unfinished_requests()
