"""The OpenAI door's structured-output fields and tool calls: which constraint a body asks for,
the tool-call constraint's schema, and the parsers of the models' own tool-call formats."""

import json

import jsonschema
import pytest
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.gateway.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)
from pagedserve.services.gateway.openai.structured import structured_outputs
from pagedserve.services.gateway.openai.tools import (
    ToolUse,
    parse_tool_calls,
    parser_for_template,
    tool_constraint,
    tool_use,
)

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}
WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "time"}}
USER = [{"role": "user", "content": "hi"}]
AUTO = ToolUse([WEATHER, TIME], "auto")


def _completion(**fields):
    return CompletionRequest(prompt="x", **fields)


def _chat(**fields):
    return ChatCompletionRequest(messages=USER, **fields)


@pytest.mark.parametrize(("fields", "expected"), [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA,
                                                                 "strict": True}}},
     StructuredOutputsParams(json_schema=SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredOutputsParams(json_schema=SCHEMA)),
    ({"structured_outputs": {"choice": ["a", "b"]}}, StructuredOutputsParams(choice=("a", "b"))),
    ({"guided_regex": "a+", "guided_decoding_backend": "guidance"},
     StructuredOutputsParams(regex="a+")),
    ({"guided_grammar": 'start: "x"'}, StructuredOutputsParams(grammar='start: "x"')),
    ({"guided_json": json.dumps(SCHEMA)}, StructuredOutputsParams(json_schema=json.dumps(SCHEMA))),
])
def test_each_way_of_asking_gives_one_constraint(fields, expected):
    assert structured_outputs(_completion(**fields)) == expected


@pytest.mark.parametrize(("fields", "param"), [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": "x"}},
     "response_format.json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs.whitespace_pattern"),
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": ["a"], "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
])
def test_a_bad_or_doubled_constraint_is_refused_naming_the_field(fields, param):
    with pytest.raises(InvalidRequest) as raised:
        structured_outputs(_completion(**fields))
    assert raised.value.violations[0].field == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0].function.name"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
     "tool_choice.function.name"),
])
def test_bad_tools_name_the_field(fields, param):
    with pytest.raises(InvalidRequest) as raised:
        tool_use(_chat(**fields))
    assert raised.value.violations[0].field == param


def test_required_constrains_to_calls_of_listed_tools():
    use = tool_use(_chat(tools=[WEATHER, TIME], tool_choice="required"))
    schema = json.loads(tool_constraint(use, parallel_tool_calls=True).json_schema)
    jsonschema.validate([{"name": "weather", "parameters": {"city": "Oslo"}},
                         {"name": "time", "parameters": {}}], schema)
    for bad in ([], [{"name": "weather", "parameters": {}}], [{"name": "x", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(tool_constraint(use, parallel_tool_calls=False).json_schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "time", "parameters": {}}] * 2, single)


def test_a_named_function_constrains_to_its_arguments_and_auto_to_nothing():
    named = tool_use(_chat(tools=[WEATHER], tool_choice={"type": "function",
                                                         "function": {"name": "weather"}}))
    assert json.loads(tool_constraint(named, True).json_schema) == \
        WEATHER["function"]["parameters"]
    content, calls = parse_tool_calls('{"city": "Oslo"}', named, "")
    assert content is None and calls[0].function.name == "weather"
    assert tool_constraint(tool_use(_chat(tools=[WEATHER])), True) is None


def test_hermes_calls_after_content():
    text = ('Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
            '</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>')
    content, calls = parse_tool_calls(text, AUTO, "hermes")
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("time", {})]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_calls("<tool_call>{not json</tool_call>", AUTO, "hermes") == (
        "<tool_call>{not json</tool_call>", [])


def test_llama3_json_calls_and_plain_text():
    content, calls = parse_tool_calls(
        '<|python_tag|>{"name": "weather", "parameters": {"city": "Rome"}}; '
        '{"name": "time", "parameters": {}}', AUTO, "llama3_json")
    assert content is None and [c.function.name for c in calls] == ["weather", "time"]
    assert parse_tool_calls("The weather is fine.", AUTO, "llama3_json") == (
        "The weather is fine.", [])


def test_auto_without_a_parser_keeps_content_and_templates_pick_theirs():
    use = tool_use(_chat(tools=[WEATHER]))
    text = '{"name": "weather", "parameters": {"city": "Rome"}}'
    assert parse_tool_calls(text, use, "") == (text, [])
    assert parse_tool_calls(text, use, "llama3_json")[1][0].function.name == "weather"
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("<|start_header_id|>ipython") == "llama3_json"
    assert parser_for_template("<|im_start|>") == ""
