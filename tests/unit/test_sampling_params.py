"""SamplingParams ranges: values that would break a step (inf, NaN, overflowing penalties) are
refused with the field and the value named, at the gateway and the scheduler alike."""

from __future__ import annotations

import math

import pytest
import torch
from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.convert_common import sampling_params_from_proto
from pagedserve.services.rpc.internal.v1 import common_pb2
from pagedserve.worker_svc.sampler import Sampler, SeqSamplingState


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.inf), ("temperature", math.nan), ("top_p", math.nan),
    ("min_p", math.nan), ("presence_penalty", math.inf), ("frequency_penalty", -math.inf),
    ("repetition_penalty", math.inf), ("repetition_penalty", math.nan),
    ("repetition_penalty", 5e-324), ("repetition_penalty", 1e6),
    ("length_penalty", math.nan), ("length_penalty", math.inf), ("length_penalty", 1e4),
])
def test_non_finite_and_overflowing_values_are_refused(field, value):
    with pytest.raises(InvalidRequest, match=field) as info:
        SamplingParams(**{field: value})
    assert str(value) in str(info.value)


@pytest.mark.parametrize(("field", "value"), [
    ("temperature", math.inf), ("repetition_penalty", 5e-324), ("length_penalty", math.nan)])
def test_the_wire_form_is_refused_too(field, value):
    """What the gateway and the scheduler both build from their protos."""
    with pytest.raises(InvalidRequest, match=field):
        sampling_params_from_proto(common_pb2.SamplingParams(**{field: value}))


def test_usual_values_stay_accepted():
    SamplingParams(temperature=2.0, repetition_penalty=1.3, length_penalty=-1.0)
    SamplingParams(repetition_penalty=0.01, length_penalty=10.0)
    SamplingParams(repetition_penalty=100.0, temperature=1e9)


@pytest.mark.parametrize("penalty", [0.01, 100.0])
def test_the_extreme_repetition_penalties_keep_logprobs_finite(penalty):
    """The ends of the allowed range on large float32 logits: no inf, no NaN."""
    vocab = 32
    sampler = Sampler(vocab, [0], torch.device("cpu"))
    logits = torch.linspace(-60.0, 60.0, vocab).unsqueeze(0)  # [1, vocab]
    state = SeqSamplingState(seq_id=0, sampling=SamplingParams(
        temperature=1.0, repetition_penalty=penalty, logprobs=5, seed=1),
        token_ids=list(range(vocab)), prompt_len=vocab, seed=1, num_samples=1)
    (out,) = sampler(logits, [state])
    assert all(math.isfinite(x) for x in out.logprobs)
    assert all(math.isfinite(c.logprob) for c in out.top_logprobs[0])


def test_every_bad_field_is_a_violation_and_the_first_one_is_the_message():
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(temperature=-1.0, top_p=0.0, stop=["ok", ""], max_tokens=0)
    error = info.value
    assert error.reason == Reason.INVALID_SAMPLING_PARAMS
    assert [v.field for v in error.violations] == ["temperature", "top_p", "max_tokens", "stop[1]"]
    assert str(error) == "temperature must be >= 0, got -1.0" == error.violations[0].description
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(stop_token_ids=[3, 900, 5, 901]).verify_for_model(512)
    assert info.value.reason == Reason.UNKNOWN_TOKEN_ID
    assert [v.field for v in info.value.violations] == ["stop_token_ids[1]", "stop_token_ids[3]"]


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"logit_bias": {3: 101.0}}, "logit_bias"), ({"logit_bias": {3: math.nan}}, "logit_bias"),
    ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [-2]}, "allowed_token_ids"), ({"bad_words": ["ok", " "]}, "bad_words[1]"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens")])
def test_token_constraints_out_of_range_are_refused(kwargs, field):
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert [v.field for v in info.value.violations] == [field]


def test_token_ids_beyond_the_vocabulary_are_refused_for_the_model():
    for kwargs, field in (({"logit_bias": {99: 1.0}}, "logit_bias[99]"),
                          ({"allowed_token_ids": [1, 99]}, "allowed_token_ids[1]")):
        with pytest.raises(InvalidRequest) as info:
            SamplingParams(**kwargs).verify_for_model(50)
        assert info.value.reason == Reason.UNKNOWN_TOKEN_ID
        assert [v.field for v in info.value.violations] == [field]


def test_greedy_with_n_above_one_is_accepted():
    assert SamplingParams(temperature=0.0, n=3).num_candidates == 3
