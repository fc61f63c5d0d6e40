"""common.proto converters: every field survives the wire, unset fields take vLLM's defaults."""

import dataclasses

import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.outputs import FinishReason, Usage
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenLogprob
from pagedserve.services.rpc.convert_common import (
    add_logprob_lists,
    finish_reason_from_proto,
    finish_reason_to_proto,
    logprob_lists_from_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    token_logprob_from_proto,
    token_logprob_to_proto,
    token_logprobs_from_proto,
    token_logprobs_to_proto,
    usage_from_proto,
    usage_to_proto,
)
from pagedserve.services.rpc.v1 import common_pb2, scheduler_pb2


def _wire(msg):
    """Serialize and parse, as a gRPC call does."""
    return type(msg).FromString(msg.SerializeToString())


BEAM = SamplingParams(
    n=2, best_of=3, use_beam_search=True, length_penalty=0.7, temperature=0.0, top_p=0.9,
    top_k=5, min_p=0.05, presence_penalty=0.3, frequency_penalty=-0.4, repetition_penalty=1.1,
    seed=-7, stop=("###", "\n\n"), stop_token_ids=(7, 49151), include_stop_str_in_output=True,
    ignore_eos=True, max_tokens=33, min_tokens=2, logprobs=5, prompt_logprobs=0,
    skip_special_tokens=False)
RANDOM = dataclasses.replace(BEAM, use_beam_search=False, temperature=0.123456789, top_k=-1,
                             seed=2**62, prompt_logprobs=20)


def test_every_sampling_field_is_in_the_proto():
    proto_fields = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert {f.name for f in dataclasses.fields(SamplingParams)} == proto_fields


def test_the_beam_case_sets_every_field():
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        assert getattr(BEAM, f.name) != getattr(defaults, f.name), f.name


@pytest.mark.parametrize("params", [BEAM, RANDOM], ids=["beam", "random"])
def test_sampling_params_round_trip_keeps_every_field(params):
    assert sampling_params_from_proto(_wire(sampling_params_to_proto(params))) == params


def test_default_sampling_params_round_trip():
    assert sampling_params_from_proto(_wire(sampling_params_to_proto(SamplingParams()))) == SamplingParams()


def test_unset_fields_take_vllm_defaults():
    params = sampling_params_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams()
    assert (params.n, params.temperature, params.max_tokens, params.best_of) == (1, 1.0, 16, None)
    assert params.skip_special_tokens is True


def test_explicit_zero_temperature_is_greedy_not_default():
    params = sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0))
    assert params.temperature == 0.0 and params.is_greedy


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("max_tokens", 0), ("n", -1),
                                          ("logprobs", 21), ("presence_penalty", 2.5)])
def test_invalid_proto_values_name_the_field(field, value):
    with pytest.raises(InvalidRequest, match=field):
        sampling_params_from_proto(common_pb2.SamplingParams(**{field: value}))


def test_values_outside_the_wire_range_name_the_field():
    with pytest.raises(InvalidRequest, match="max_tokens"):
        sampling_params_to_proto(SamplingParams(max_tokens=2**40))
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        sampling_params_to_proto(SamplingParams(stop_token_ids=(2**33,)))


def test_token_logprobs_round_trip():
    candidates = [TokenLogprob(17, -0.123456789012345), TokenLogprob(4_000_000_000, -42.5)]
    assert token_logprobs_from_proto(_wire(token_logprobs_to_proto(candidates))) == candidates
    msg = _wire(token_logprob_to_proto(candidates[0], text=" Paris"))
    assert msg.text == " Paris"
    assert token_logprob_from_proto(msg) == candidates[0]


def test_logprob_lists_round_trip():
    positions = [[TokenLogprob(1, -0.5), TokenLogprob(2, -1.25)], [], [TokenLogprob(3, -3e-9)]]
    event = scheduler_pb2.TokenEvent()  # any message with a repeated TokenLogprobs field
    add_logprob_lists(event.prompt_logprobs, positions)
    assert logprob_lists_from_proto(_wire(event).prompt_logprobs) == positions


@pytest.mark.parametrize("reason", [*FinishReason, None])
def test_finish_reason_round_trip(reason):
    value = finish_reason_to_proto(reason)
    assert common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_") == (
        reason or "unspecified").upper()
    assert finish_reason_from_proto(value) is reason


def test_finish_reasons_read_as_vllm_words():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert f"{FinishReason.STOP}" == "stop" and FinishReason("length") is FinishReason.LENGTH


def test_unknown_finish_reasons_are_refused():
    with pytest.raises(ValueError, match="'eos'"):
        finish_reason_to_proto("eos")
    with pytest.raises(ValueError, match="99"):
        finish_reason_from_proto(99)


def test_usage_round_trip():
    usage = Usage(prompt_tokens=1234, completion_tokens=56, cached_tokens=1024)
    assert usage_from_proto(_wire(usage_to_proto(usage))) == usage
