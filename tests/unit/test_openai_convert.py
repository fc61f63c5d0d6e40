"""OpenAI request bodies → GenerateInput and SamplingParams (no server)."""

import dataclasses

import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.openai.convert import (
    chat_max_tokens,
    chat_messages,
    chat_top_logprobs,
    completion_prompts,
    sampling_params,
)
from pagedserve.services.gateway.openai.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
)
from pagedserve.services.gateway.validation import ChatMessage, ServedModel


def test_every_prompt_shape():
    assert [p.text for p in completion_prompts("a")] == ["a"]
    assert [p.text for p in completion_prompts(["a", "b"])] == ["a", "b"]
    assert [p.token_ids for p in completion_prompts([1, 2])] == [(1, 2)]
    assert [p.token_ids for p in completion_prompts([[1], [2, 3]])] == [(1,), (2, 3)]
    for bad in ([], [1, "a"], [True, 2], [[1], "a"], [{"x": 1}]):
        with pytest.raises(InvalidRequest, match="prompt must"):
            completion_prompts(bad)


def test_unset_fields_keep_the_sampling_defaults_and_set_ones_map_by_name():
    assert sampling_params(CompletionRequest(prompt="x"), None, None) == SamplingParams()
    body = CompletionRequest(prompt="x", n=2, temperature=0.5, top_p=0.9, stop="END", seed=7,
                             presence_penalty=0.1, frequency_penalty=0.2, top_k=5, min_p=0.1,
                             repetition_penalty=1.1, min_tokens=2, ignore_eos=True,
                             stop_token_ids=[3], best_of=3, skip_special_tokens=False,
                             include_stop_str_in_output=True)
    assert sampling_params(body, 8, 2) == SamplingParams(
        n=2, temperature=0.5, top_p=0.9, stop=("END",), seed=7, presence_penalty=0.1,
        frequency_penalty=0.2, top_k=5, min_p=0.1, repetition_penalty=1.1, min_tokens=2,
        ignore_eos=True, stop_token_ids=(3,), best_of=3, skip_special_tokens=False,
        include_stop_str_in_output=True, max_tokens=8, logprobs=2)


def test_chat_content_parts_and_token_budget():
    messages = [ChatMessageIn(role="system", content="be brief"),
                ChatMessageIn(role="user", content=[{"type": "text", "text": "a"},
                                                    {"type": "text", "text": "b"}]),
                ChatMessageIn(role="assistant", content=None)]
    assert chat_messages(messages) == (ChatMessage("system", "be brief"),
                                       ChatMessage("user", "a\nb"), ChatMessage("assistant", ""))
    body = ChatCompletionRequest(messages=messages)
    info = ServedModel(model="m", architecture="LlamaForCausalLM", max_model_len=100,
                       vocab_size=512, eos_token_ids=(2,), has_chat_template=True)
    assert chat_max_tokens(body, 10, info) == 90
    assert chat_max_tokens(body.model_copy(update={"max_tokens": 5}), 10, info) == 5
    assert chat_max_tokens(body.model_copy(update={"max_tokens": 5,
                                                   "max_completion_tokens": 7}), 10, info) == 7
    # 4 KV blocks of 16 tokens: one sequence gets 64 - 10 - 16 (a block of slack), two 32 - 26
    small_cache = dataclasses.replace(info, block_size=16, num_gpu_blocks=4)
    assert chat_max_tokens(body, 10, small_cache) == 38
    assert chat_max_tokens(body.model_copy(update={"n": 2}), 10, small_cache) == 6
    assert chat_top_logprobs(body) is None
    assert chat_top_logprobs(body.model_copy(update={"logprobs": True})) == 0
    assert chat_top_logprobs(body.model_copy(update={"logprobs": True, "top_logprobs": 4})) == 4
