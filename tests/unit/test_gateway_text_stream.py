"""TextStream and prepare_request without gRPC: token events in, client deltas out."""

import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.outputs import FinishReason, RequestOutput, SequenceDelta
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob
from pagedserve.services.gateway.validation import (
    ChatMessage,
    GenerateInput,
    ServedModel,
    prepare_request,
)
from pagedserve.services.text.text_stream import TextStream

from tests.unit.tiny_tokenizers import byte_level_bpe

TOKENIZER = byte_level_bpe()
INFO = ServedModel("tiny", "LlamaForCausalLM", 32, TOKENIZER.vocab_size, (2,), True)


def ids(text):
    return TOKENIZER.encode(text, add_special_tokens=False)


def _stream(**sampling):
    return TextStream(ids("the fox"), SamplingParams(**sampling), TOKENIZER)


def event(*outputs, **kw):
    return RequestOutput("r", list(outputs), finished=False, num_prompt_tokens=2,
                         num_cached_tokens=0, **kw)


def token_events(text, index=0, finish="stop"):
    token_ids = ids(text)
    return [event(SequenceDelta(index, [t], finish_reason=finish if i == len(token_ids) - 1
                                else None)) for i, t in enumerate(token_ids)]


def run(stream, events):
    return [d for e in events for d in stream.on_output(e)]


def test_stop_string_at_the_very_end_is_found_after_the_flush():
    # "END" arrives in the last token with the scheduler's EOS: still a stop-string finish
    stream = _stream(stop=["END"])
    deltas = run(stream, token_events("hello END"))
    assert "".join(d.text for d in deltas) == "hello "
    assert deltas[-1].finish_reason == "stop"


def test_held_text_is_released_when_the_sequence_ends():
    stream = _stream(stop=["there!"])
    deltas = run(stream, token_events("hello there", finish="length"))
    assert "".join(d.text for d in deltas) == "hello there"
    assert deltas[-1].finish_reason == "length"
    assert deltas[-1].usage.completion_tokens == len(ids("hello there"))


def test_n2_one_index_stopped_the_other_runs_on():
    stream = _stream(n=2, stop=["X"], temperature=0.8)
    first = stream.on_output(event(SequenceDelta(0, ids("aX")), SequenceDelta(1, ids("ab"))))
    assert [(d.index, d.text, d.finish_reason) for d in first] == [(0, "a", "stop"), (1, "ab", None)]
    assert not stream.is_finished and all(d.usage is None for d in first)
    later = stream.on_output(event(SequenceDelta(0, ids("zz")),  # the scheduler ran on: dropped
                                   SequenceDelta(1, ids("c"), finish_reason="length")))
    assert [(d.index, d.text, d.finish_reason) for d in later] == [(1, "c", "length")]
    assert stream.is_finished
    assert later[-1].usage.completion_tokens == len(ids("aX")) + len(ids("abc"))


def test_logprobs_and_prompt_logprobs_carry_token_text():
    stream = _stream(logprobs=1, prompt_logprobs=1)
    token = ids(" fox")[0]
    deltas = stream.on_output(event(
        SequenceDelta(0, [token], logprobs=[-0.1], top_logprobs=[[TokenIdLogprob(token, -0.1)]]),
        prompt_logprobs=[None, [TokenIdLogprob(token, -3.0)]]))
    (delta,) = deltas
    assert [(lp.token_id, lp.text) for lp in delta.logprobs] == [(token, " fox")]
    assert delta.top_logprobs[0][0].text == " fox"
    assert delta.prompt_logprobs[0] == []  # a prefix-cache hit: no logprobs there
    assert delta.prompt_logprobs[1][0].logprob == -3.0


def test_held_back_text_still_streams_token_ids():
    stream = _stream(stop=["STOP"])
    deltas = stream.on_output(event(SequenceDelta(0, ids("ok ST"))))
    assert deltas[0].text == "ok " and deltas[0].token_ids == ids("ok ST")


def test_prepare_request_limits():
    request = GenerateInput(token_ids=tuple(range(3, 19)), sampling=SamplingParams(max_tokens=16))
    ready = prepare_request(request, TOKENIZER, INFO)  # 16 + 16 == max_model_len: fits
    assert ready.prompt_token_ids == list(range(3, 19)) and len(ready.request_id) == 32
    too_long = GenerateInput(token_ids=tuple(range(3, 20)), sampling=SamplingParams(max_tokens=16))
    with pytest.raises(InvalidRequest, match=r"prompt \(17 tokens\) \+ max_tokens \(16\)"):
        prepare_request(too_long, TOKENIZER, INFO)
    with pytest.raises(InvalidRequest, match="request_id"):
        prepare_request(GenerateInput(request_id="x" * 300, text="hi"), TOKENIZER, INFO)


def test_text_prompt_and_messages_without_template():
    no_template = ServedModel("tiny", "LlamaForCausalLM", 32, TOKENIZER.vocab_size, (2,), False)
    with pytest.raises(InvalidRequest, match="chat template"):
        prepare_request(GenerateInput(messages=(ChatMessage("user", "hi"),)), TOKENIZER, no_template)
    ready = prepare_request(GenerateInput(text="hello there"), TOKENIZER, INFO)
    assert ready.prompt_token_ids == TOKENIZER.encode("hello there")


def test_tokens_after_the_stop_string_are_cut():
    # a whole output in one event (beam search, best_of > n): the stop falls inside it
    stream = _stream(stop=["X"], logprobs=0)
    kept, dropped = ids("hello") + ids("X"), ids("world")
    tokens = kept + dropped
    (delta,) = stream.on_output(event(SequenceDelta(
        0, tokens, logprobs=[-1.0] * len(tokens), finish_reason=FinishReason.LENGTH)))
    assert (delta.text, delta.token_ids, delta.finish_reason) == ("hello", kept, "stop")
    assert len(delta.logprobs) == len(kept)
    assert delta.usage.completion_tokens == len(kept)


def test_take_stopped_names_the_outputs_a_stop_string_ended_before_the_engine():
    stream = _stream(n=2, stop=["fox"])
    first = [SequenceDelta(0, [t]) for t in ids("a fox ran")]
    second = [SequenceDelta(1, [t]) for t in ids("no stop")]
    stopped_at = []
    for i, completion in enumerate(first):
        stream.on_output(event(completion, *second[i:i + 1]))
        stopped_at += [(i, index) for index in stream.take_stopped()]
    assert stopped_at == [(len(ids("a fox")) - 1, 0)]  # once, at the token that completed it
    assert stream.is_output_finished(0) and not stream.is_output_finished(1)


def test_take_stopped_leaves_out_an_output_the_engine_ended_in_the_same_token():
    stream = _stream(stop=["END"])
    run(stream, token_events("hello END"))  # the stop string and the engine's EOS together
    assert stream.take_stopped() == []


@pytest.mark.parametrize("stop", [[], ["fox"]])
def test_merged_steps_stream_the_text_and_tokens_of_the_steps_one_by_one(stop):
    """A scheduler behind its caller merges steps: one event of several tokens, with or without
    stop strings, gives the text, ids and finish the events one by one give."""
    text = "héllo wörld, the quick fox ran 🦊 far"
    one_by_one = run(_stream(stop=stop), token_events(text, finish="length"))
    token_ids = ids(text)
    merged = run(_stream(stop=stop), [
        event(SequenceDelta(0, token_ids[i:i + 3],
                            finish_reason="length" if i + 3 >= len(token_ids) else None))
        for i in range(0, len(token_ids), 3)])
    for deltas in (one_by_one, merged):
        assert deltas[-1].finish_reason == ("stop" if stop else "length")
    assert "".join(d.text for d in merged) == "".join(d.text for d in one_by_one)
    assert ([t for d in merged for t in d.token_ids]
            == [t for d in one_by_one for t in d.token_ids])
    assert len(merged) < len(one_by_one)


def test_beam_search_ends_with_its_report_whatever_number_of_completions_it_has():
    """A constraint may admit fewer completions than n beams: those are all the report holds."""
    stream = _stream(n=3, best_of=3, use_beam_search=True, temperature=0.0)
    final = RequestOutput("r", [SequenceDelta(0, ids("yes"), finish_reason="stop")],
                          finished=True, num_prompt_tokens=2, num_cached_tokens=0)
    (delta,) = stream.on_output(final)
    assert stream.is_finished and delta.text == "yes" and delta.usage is not None
