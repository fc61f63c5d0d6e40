"""Tool calling on the chat endpoint: the request's `tools` and `tool_choice`, the constraint that
`required` and a named function put on the output, and the parsers that read a model's own
tool-call format under `auto` (vLLM's --tool-call-parser names)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.gateway.openai.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    ToolCall,
)

_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What a chat request asked of its tools. mode: none, auto, required or named."""

    tools: list[dict[str, Any]]  # the request's, as the chat template receives them
    mode: str
    named: str | None = None  # the function `named` forces

    @property
    def parses_output(self) -> bool:
        return self.mode != "none"


def _invalid(field: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{field} {message}", reason=Reason.INVALID_SAMPLING_PARAMS, field=field)


def _function(tool: Any, index: int) -> dict[str, Any]:
    field = f"tools[{index}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise _invalid(f"{field}.type", f"must be 'function', got {tool!r:.80}")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
            or not function["name"]:
        raise _invalid(f"{field}.function.name", f"must be a non-empty string, got "
                       f"{function!r:.80}")
    parameters = function.get("parameters", {"type": "object"})
    if not isinstance(parameters, dict):
        raise _invalid(f"{field}.function.parameters", f"must be a JSON schema object, got "
                       f"{parameters!r:.80}")
    return function


def tool_use(body: ChatCompletionRequest) -> ToolUse | None:
    """None: no tools (tool_choice alone is refused, as OpenAI does)."""
    if not body.tools:
        if body.tool_choice not in (None, "none"):
            raise _invalid("tool_choice", f"needs tools, got {body.tool_choice!r:.80}")
        return None
    functions = [_function(t, i) for i, t in enumerate(body.tools)]
    choice = body.tool_choice or "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise _invalid("tool_choice", f"must be none, auto, required or "
                           f"{{'type': 'function', 'function': {{'name': ...}}}}, got {choice!r}")
        return ToolUse(body.tools, choice)
    name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
    if name not in {f["name"] for f in functions}:
        raise _invalid("tool_choice.function.name", f"must name one of the tools "
                       f"{[f['name'] for f in functions]}, got {name!r}")
    return ToolUse(body.tools, "named", name)


def tool_constraint(use: ToolUse | None, parallel_tool_calls: bool
                    ) -> StructuredOutputsParams | None:
    """required: a JSON list of {name, parameters} calls of listed tools (one at most without
    parallel calls); named: the function's arguments alone."""
    if use is None or use.mode not in ("required", "named"):
        return None
    functions = [t["function"] for t in use.tools]
    if use.mode == "named":
        function = next(f for f in functions if f["name"] == use.named)
        return StructuredOutputsParams(json_schema=function.get("parameters",
                                                                {"type": "object"}))
    calls = [{"type": "object", "properties": {
        "name": {"const": f["name"]},
        "parameters": f.get("parameters", {"type": "object"})},
        "required": ["name", "parameters"], "additionalProperties": False}
        for f in functions]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return StructuredOutputsParams(json_schema=schema)


def _call(name: str, arguments: Any) -> ToolCall:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=text))


def _calls_of(objects: list[Any]) -> list[ToolCall]:
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        arguments = obj.get("arguments", obj.get("parameters", {}))
        calls.append(_call(obj["name"], arguments))
    return calls


def _json_values(text: str) -> list[Any]:
    """Consecutive JSON values, separated by whitespace or ';' (Llama 3.x's parallel calls)."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while i < len(text):
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            break
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        values.append(value)
    return values


def parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    """Hermes, Qwen2.5: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after
    optional content."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    objects = []
    for body in _HERMES_CALL.findall(text[start:]):
        values = _json_values(body)
        if len(values) != 1:
            return text, []
        objects.append(values[0])
    calls = _calls_of(objects)
    return (text[:start].strip(), calls) if calls else (text, [])


def parse_llama3_json(text: str) -> tuple[str, list[ToolCall]]:
    """Llama 3.x: the whole output is `{"name": ..., "parameters": {...}}` (several joined by
    ';'), optionally after <|python_tag|>."""
    body = text.strip().removeprefix(_PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, []
    calls = _calls_of(_json_values(body))
    return ("", calls) if calls else (text, [])


PARSERS: dict[str, Callable[[str], tuple[str, list[ToolCall]]]] = {
    "hermes": parse_hermes, "llama3_json": parse_llama3_json}


def parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template's own tool-call format needs; "" if it shows none."""
    template = chat_template or ""
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3_json"
    return ""


def parse_tool_calls(text: str, use: ToolUse, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of one finished choice."""
    if use.mode == "named":
        return None, [_call(use.named, text)]
    if use.mode == "required":
        values = _json_values(text)
        calls = _calls_of(values[0]) if len(values) == 1 and isinstance(values[0], list) else []
        return (None, calls) if calls else (text, [])
    if use.mode == "auto" and parser:
        content, calls = PARSERS[parser](text)
        return (content or None, calls) if calls else (text, [])
    return text, []
