"""The client's requests from Python values: each prompt kind, sampling as keywords or a
SamplingParams, and bad values refused before any call, naming what was wrong."""

import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.client import types


def _request(prompt=None, messages=None, **sampling):
    return types.generate_request(prompt, messages, types.sampling_params(None, sampling),
                                  None, 0)


def test_each_prompt_kind_fills_its_oneof_and_an_id_is_made():
    assert _request("hi").text == "hi"
    assert list(_request([3, 4]).token_ids.token_ids) == [3, 4]
    chat = _request(messages=[{"role": "user", "content": "hi"}])
    assert [(m.role, m.content) for m in chat.messages.messages] == [("user", "hi")]
    assert len({_request("hi").request_id for _ in range(3)}) == 3


def test_sampling_keywords_become_the_proto_fields_and_unset_ones_stay_unset():
    sampling = _request("hi", temperature=0.0, max_tokens=5, stop=["x"]).sampling
    assert (sampling.temperature, sampling.max_tokens, list(sampling.stop)) == (0.0, 5, ["x"])
    assert not sampling.HasField("seed")


@pytest.mark.parametrize("prompt, messages, words", [
    (b"ab", None, "prompt must be"),
    ([1, "2"], None, "prompt must be"),
    (None, [{"role": "user"}], "messages[0]"),
    (None, ["hi"], "messages[0]"),
])
def test_bad_prompts_are_refused_by_name(prompt, messages, words):
    with pytest.raises(InvalidRequest, match=words.replace("[", r"\[")):
        _request(prompt, messages)


def test_sampling_is_keywords_or_a_sampling_params_not_both():
    with pytest.raises(InvalidRequest, match="not both"):
        types.sampling_params(SamplingParams(), {"temperature": 0.0})
    with pytest.raises(InvalidRequest, match="max_token"):
        types.sampling_params(None, {"max_token": 3})
    assert types.sampling_params(None, {"n": 2}) == SamplingParams(n=2)


def test_a_stream_request_keeps_every_field_of_the_request():
    request = _request(messages=[{"role": "user", "content": "hi"}], n=2, temperature=0.5,
                       seed=3)
    request.priority = 7
    streamed = types.stream_request(request)
    assert streamed.SerializeToString() == request.SerializeToString()
    assert (streamed.request_id, streamed.priority, streamed.sampling.n) == (
        request.request_id, 7, 2)
