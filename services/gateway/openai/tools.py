"""Tool calling on the chat endpoint: the request's `tools` and `tool_choice`, the constraint that
`required` and a named function put on the output, and the parsers that read a model's own
tool-call format under `auto` (vLLM's --tool-call-parser names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.gateway.openai.protocol import (
    ChatCompletionRequest,
    FunctionCall,
    ToolCall,
)
from pagedserve.services.gateway.openai.tool_parser import (
    HERMES_TAG,
    PYTHON_TAG,
    CallStart,
    Piece,
    ToolCallParser,
)


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


def parser_for_template(chat_template: str | None) -> str:
    """The parser a chat template's own tool-call format needs; "" if it shows none."""
    template = chat_template or ""
    if HERMES_TAG in template:
        return "hermes"
    if PYTHON_TAG in template or "ipython" in template:
        return "llama3_json"
    return ""


def tool_call_parser(use: ToolUse, parser: str) -> ToolCallParser:
    """A choice's parser; `parser` reads `auto`'s calls ("": none, all is content)."""
    return ToolCallParser(use.mode, parser, use.named)


def tool_calls_of(pieces: list[Piece]) -> tuple[str, list[ToolCall]]:
    """The content and the calls a parser's pieces make."""
    content, calls = [], []
    for piece in pieces:
        if isinstance(piece, str):
            content.append(piece)
        elif isinstance(piece, CallStart):
            calls.append(ToolCall(id=piece.id, function=FunctionCall(name=piece.name,
                                                                     arguments="")))
        else:
            calls[piece.index].function.arguments += piece.text
    return "".join(content), calls


def parse_tool_calls(text: str, use: ToolUse, parser: str) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of one finished choice: what its streamed pieces add up to."""
    reader = tool_call_parser(use, parser)
    content, calls = tool_calls_of(reader.feed(text) + reader.finish())
    return (content or None, calls) if calls else (content, [])
