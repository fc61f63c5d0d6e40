"""Structured outputs and tool calls with the real default model, through both doors and the
offline LLM: every output parses and validates, bad constraints are refused naming the field."""

import json
import re

import grpc
import jsonschema
import openai
import pytest
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2

from pagedserve.llm import LLM
from tests.e2e.stack import tiny_config

pytestmark = pytest.mark.slow

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3}},
    "required": ["name", "age"], "additionalProperties": False}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "timezone": {"type": "string", "maxLength": 20}}, "required": ["timezone"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def stack_config(smollm2_dir):
    return tiny_config(smollm2_dir, kv_cache_memory_gib=0.1, swap_space_gib=0.05)


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        yield client


def _response_format(schema):
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema,
                                                   "strict": True}}


def test_chat_json_schema_greedy_and_sampled_outputs_validate(client, smollm2_dir):
    greedy = client.chat.completions.create(
        model=smollm2_dir.name, messages=ASK, temperature=0, max_tokens=80,
        response_format=_response_format(PERSON))
    sampled = client.chat.completions.create(
        model=smollm2_dir.name, messages=ASK, temperature=1.0, seed=7, n=3, max_tokens=80,
        response_format=_response_format(PERSON))
    for choice in greedy.choices + sampled.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_completions_guided_fields(client, smollm2_dir):
    choice = client.completions.create(model=smollm2_dir.name, prompt="Is the sky blue?",
                                       max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert choice.choices[0].text in ("yes", "no", "maybe")
    phone = client.completions.create(model=smollm2_dir.name, prompt="Call me at",
                                      max_tokens=16, temperature=0,
                                      extra_body={"guided_regex": r" \d{3}-\d{4}"})
    assert re.fullmatch(r" \d{3}-\d{4}", phone.choices[0].text)
    obj = client.completions.create(model=smollm2_dir.name, prompt="A JSON object:",
                                    max_tokens=60, temperature=0,
                                    extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(obj.choices[0].text), dict)


def test_the_grpc_door_takes_the_constraint_and_refuses_one_that_cannot_compile(generation):
    response = generation.Generate(gateway_pb2.GenerateRequest(
        messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**ASK[0])]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=80,
                                           structured_outputs=common_pb2.StructuredOutputs(
                                               json_schema=json.dumps(PERSON)))))
    jsonschema.validate(json.loads(response.outputs[0].text), PERSON)
    with pytest.raises(grpc.RpcError) as raised:
        generation.Generate(gateway_pb2.GenerateRequest(
            text="x", sampling=common_pb2.SamplingParams(
                structured_outputs=common_pb2.StructuredOutputs(regex="[a-"))))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_outputs.regex" in raised.value.details()


def test_offline_llm_equals_the_services(generation, smollm2_dir):
    llm = LLM(model=str(smollm2_dir), device="cpu", kv_cache_memory_gib=0.05,
              swap_space_gib=0.05)
    offline = llm.chat(ASK, SamplingParams(temperature=0.0, max_tokens=80,
                                           structured_outputs=StructuredOutputsParams(
                                               json_schema=PERSON)), use_tqdm=False)
    served = generation.Generate(gateway_pb2.GenerateRequest(
        messages=common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**ASK[0])]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=80,
                                           structured_outputs=common_pb2.StructuredOutputs(
                                               json_schema=json.dumps(PERSON)))))
    assert offline[0].outputs[0].text == served.outputs[0].text


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tool_choice_required_calls_listed_tools_with_valid_arguments(client, smollm2_dir,
                                                                      temperature):
    chat = client.chat.completions.create(
        model=smollm2_dir.name, temperature=temperature, seed=3, max_tokens=120, tools=TOOLS,
        tool_choice="required",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}])
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])


def _streamed_calls(chunks) -> list[tuple[str, str]]:
    """(name, arguments) of each call, its arguments joined from the fragments."""
    calls: list[list[str]] = []
    for delta in (d for c in chunks for d in (c.choices[0].delta.tool_calls or [])):
        if delta.index == len(calls):
            assert delta.id and delta.type == "function" and delta.function.arguments == ""
            calls.append([delta.function.name, ""])
        else:
            assert delta.function.name is None
            calls[delta.index][1] += delta.function.arguments
    return [tuple(c) for c in calls]


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_time"}}, "required"], ids=["named", "required"])
def test_streamed_tool_call_arguments_join_into_the_returned_ones(client, smollm2_dir,
                                                                  tool_choice):
    request = {"model": smollm2_dir.name, "temperature": 0, "max_tokens": 120, "tools": TOOLS,
               "tool_choice": tool_choice,
               "messages": [{"role": "user", "content": "What time is it in Tokyo?"}]}
    whole = client.chat.completions.create(**request).choices[0]
    calls = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    if tool_choice != "required":
        assert [name for name, _ in calls] == ["get_time"]
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    chunks = list(client.chat.completions.create(stream=True, **request))
    assert _streamed_calls(chunks) == calls
    num_fragments = sum(len(c.choices[0].delta.tool_calls or []) for c in chunks)
    assert num_fragments > 2 * len(calls)  # the arguments come as they are generated
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert whole.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")


def test_parallel_tool_calls_false_makes_one_call(client, smollm2_dir):
    chat = client.chat.completions.create(
        model=smollm2_dir.name, temperature=1.0, seed=11, max_tokens=160, tools=TOOLS,
        tool_choice="required", parallel_tool_calls=False,
        messages=[{"role": "user", "content": "Weather in Paris and time in Rome?"}])
    assert len(chat.choices[0].message.tool_calls) == 1


def test_beam_search_keeps_each_beam_in_its_constraint(client, generation, smollm2_dir):
    beams = client.chat.completions.create(
        model=smollm2_dir.name, messages=ASK, temperature=0, max_tokens=80, n=2,
        response_format=_response_format(PERSON), extra_body={"use_beam_search": True})
    assert len(beams.choices) == 2
    for choice in beams.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), PERSON)
    # one completion for three beams: the outputs are the completions there are, at both doors
    response = generation.Generate(gateway_pb2.GenerateRequest(
        text="Say a:", sampling=common_pb2.SamplingParams(
            n=3, temperature=0.0, max_tokens=8, use_beam_search=True,
            structured_outputs=common_pb2.StructuredOutputs(
                choice=common_pb2.Choice(choices=["a"])))))
    assert 1 <= len(response.outputs) < 3
    assert [(o.index, o.text) for o in response.outputs] == [
        (i, "a") for i in range(len(response.outputs))]
    completion = client.completions.create(
        model=smollm2_dir.name, prompt="Say a:", n=3, max_tokens=8, temperature=0,
        extra_body={"use_beam_search": True, "guided_choice": ["a"]})
    assert 1 <= len(completion.choices) < 3
    assert all(c.text == "a" and c.finish_reason == "stop" for c in completion.choices)
