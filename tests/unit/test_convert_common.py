"""common.proto converters of both contracts (convert_common: internal, convert_public: public):
every field survives the wire, unset fields take vLLM's defaults."""

import dataclasses

import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.outputs import FinishReason, Usage
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.rpc import convert_common, convert_public
from pagedserve.services.rpc.convert_common import (
    add_logprob_lists,
    logprob_lists_from_proto,
    token_logprob_from_proto,
    token_logprob_to_proto,
    token_logprobs_from_proto,
    token_logprobs_to_proto,
)
from pagedserve.services.rpc.convert_public import usage_from_proto, usage_to_proto
from pagedserve.services.rpc.internal.v1 import common_pb2 as internal_common_pb2
from pagedserve.services.rpc.internal.v1 import scheduler_pb2
from pagedserve.services.rpc.v1 import common_pb2 as public_common_pb2

both_contracts = pytest.mark.parametrize(
    "convert, common_pb2", [(convert_common, internal_common_pb2),
                            (convert_public, public_common_pb2)], ids=["internal", "public"])
# what one contract leaves to the other's side: the gateway tokenizes bad words and truncates
ONLY_PUBLIC = {"bad_words", "truncate_prompt_tokens"}
ONLY_INTERNAL = {"bad_words_token_ids"}


def _carried(common_pb2, params: SamplingParams) -> SamplingParams:
    dropped = ONLY_INTERNAL if common_pb2 is public_common_pb2 else ONLY_PUBLIC
    defaults = SamplingParams()
    return dataclasses.replace(params, **{name: getattr(defaults, name) for name in dropped})


def _wire(msg):
    """Serialize and parse, as a gRPC call does."""
    return type(msg).FromString(msg.SerializeToString())


BEAM = SamplingParams(
    n=2, best_of=3, use_beam_search=True, length_penalty=0.7, temperature=0.0, top_p=0.9,
    top_k=5, min_p=0.05, presence_penalty=0.3, frequency_penalty=-0.4, repetition_penalty=1.1,
    seed=-7, stop=("###", "\n\n"), stop_token_ids=(7, 49151), include_stop_str_in_output=True,
    ignore_eos=True, max_tokens=33, min_tokens=2, logprobs=5, prompt_logprobs=0,
    skip_special_tokens=False, logit_bias={3: -100.0, 49151: 2.5}, allowed_token_ids=(3, 9),
    bad_words=("bad", "worse"), bad_words_token_ids=((5,), (6, 7)), truncate_prompt_tokens=9)
RANDOM = dataclasses.replace(BEAM, use_beam_search=False, temperature=0.123456789, top_k=-1,
                             seed=2**62, prompt_logprobs=20,
                             structured_outputs=StructuredOutputsParams(json_schema='{"a": 1}'))


@both_contracts
def test_every_sampling_field_is_in_the_proto(convert, common_pb2):
    proto_fields = set(common_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    other_side = ONLY_INTERNAL if common_pb2 is public_common_pb2 else ONLY_PUBLIC
    assert {f.name for f in dataclasses.fields(SamplingParams)} - other_side == proto_fields


def test_the_two_cases_set_every_field():
    """Beam search takes no structured outputs, so RANDOM carries those."""
    defaults = SamplingParams()
    for f in dataclasses.fields(SamplingParams):
        case = RANDOM if f.name == "structured_outputs" else BEAM
        assert getattr(case, f.name) != getattr(defaults, f.name), f.name


@both_contracts
@pytest.mark.parametrize("params", [BEAM, RANDOM, SamplingParams()],
                         ids=["beam", "random", "default"])
def test_sampling_params_round_trip_keeps_every_field(convert, common_pb2, params):
    msg = _wire(convert.sampling_params_to_proto(params))
    assert isinstance(msg, common_pb2.SamplingParams)
    assert convert.sampling_params_from_proto(msg) == _carried(common_pb2, params)


@both_contracts
@pytest.mark.parametrize("structured", [
    StructuredOutputsParams(json_object=True), StructuredOutputsParams(regex=r"\d+"),
    StructuredOutputsParams(grammar='start: "x"')], ids=["json_object", "regex", "grammar"])
def test_every_structured_outputs_kind_round_trips(convert, common_pb2, structured):
    params = SamplingParams(structured_outputs=structured)
    assert convert.sampling_params_from_proto(
        _wire(convert.sampling_params_to_proto(params))) == params


@both_contracts
def test_an_empty_structured_outputs_names_the_field(convert, common_pb2):
    msg = common_pb2.SamplingParams()
    msg.structured_outputs.SetInParent()
    with pytest.raises(InvalidRequest) as raised:
        convert.sampling_params_from_proto(msg)
    assert raised.value.violations[0].field == "structured_outputs"


@both_contracts
def test_unset_fields_take_vllm_defaults(convert, common_pb2):
    params = convert.sampling_params_from_proto(common_pb2.SamplingParams())
    assert params == SamplingParams()
    assert (params.n, params.temperature, params.max_tokens, params.best_of) == (1, 1.0, 16, None)
    assert params.skip_special_tokens is True


@both_contracts
def test_explicit_zero_temperature_is_greedy_not_default(convert, common_pb2):
    params = convert.sampling_params_from_proto(common_pb2.SamplingParams(temperature=0.0))
    assert params.temperature == 0.0 and params.is_greedy


@pytest.mark.parametrize("field, value", [("top_p", 0.0), ("max_tokens", 0), ("n", -1),
                                          ("logprobs", 21), ("presence_penalty", 2.5)])
@both_contracts
def test_invalid_proto_values_name_the_field(convert, common_pb2, field, value):
    with pytest.raises(InvalidRequest, match=field):
        convert.sampling_params_from_proto(common_pb2.SamplingParams(**{field: value}))


@both_contracts
def test_values_outside_the_wire_range_name_the_field(convert, common_pb2):
    with pytest.raises(InvalidRequest, match="max_tokens"):
        convert.sampling_params_to_proto(SamplingParams(max_tokens=2**40))
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        convert.sampling_params_to_proto(SamplingParams(stop_token_ids=(2**33,)))


def test_token_logprobs_round_trip():
    candidates = [TokenIdLogprob(17, -0.123456789012345), TokenIdLogprob(4_000_000_000, -42.5)]
    assert token_logprobs_from_proto(_wire(token_logprobs_to_proto(candidates))) == candidates
    assert token_logprob_from_proto(_wire(token_logprob_to_proto(candidates[0]))) == candidates[0]


def test_logprob_lists_round_trip():
    positions = [[TokenIdLogprob(1, -0.5), TokenIdLogprob(2, -1.25)], [], [TokenIdLogprob(3, -3e-9)]]
    event = scheduler_pb2.SubmitResponse()  # any message with a repeated TokenLogprobs field
    add_logprob_lists(event.prompt_logprobs, positions)
    assert logprob_lists_from_proto(_wire(event).prompt_logprobs) == positions


@both_contracts
@pytest.mark.parametrize("reason", [*FinishReason, None])
def test_finish_reason_round_trip(convert, common_pb2, reason):
    value = convert.finish_reason_to_proto(reason)
    assert common_pb2.FinishReason.Name(value).removeprefix("FINISH_REASON_") == (
        reason or "unspecified").upper()
    assert convert.finish_reason_from_proto(value) is reason


def test_both_contracts_number_finish_reasons_alike():
    """Tracing reads either contract's finish_reason with one converter."""
    assert (internal_common_pb2.FinishReason.items()
            == public_common_pb2.FinishReason.items())


def test_finish_reasons_read_as_vllm_words():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "error"]
    assert f"{FinishReason.STOP}" == "stop" and FinishReason("length") is FinishReason.LENGTH


@both_contracts
def test_unknown_finish_reasons_are_refused(convert, common_pb2):
    with pytest.raises(ValueError, match="'eos'"):
        convert.finish_reason_to_proto("eos")
    with pytest.raises(ValueError, match="99"):
        convert.finish_reason_from_proto(99)


def test_usage_round_trip():
    usage = Usage(prompt_tokens=1234, completion_tokens=56, cached_tokens=1024)
    assert usage_from_proto(_wire(usage_to_proto(usage))) == usage
