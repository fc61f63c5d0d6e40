"""A client's request checked against the served model and turned into prompt token ids."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from pagedserve.services.common.engine_api import MAX_REQUEST_ID_CHARS, PRIORITY_RANGE
from pagedserve.services.common.errors import FieldViolation, InvalidRequest, Reason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.text.sampling_text import truncated_prompt, with_bad_words_token_ids
from pagedserve.services.text.tokenizer import Tokenizer


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str
    tool_calls: tuple[Mapping[str, Any], ...] = ()  # an assistant's earlier calls
    tool_call_id: str = ""  # a tool message's answer to one
    name: str = ""

    def template_input(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = [dict(call) for call in self.tool_calls]
        if self.tool_call_id:
            message["tool_call_id"] = self.tool_call_id
        if self.name:
            message["name"] = self.name
        return message


@dataclass(frozen=True, slots=True)
class ChatOptions:
    """How messages are rendered (vLLM's chat request fields)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)  # chat_template_kwargs


# an embedding request computes its prompt only; the context-length checks price one token
EMBED_SAMPLING = SamplingParams(max_tokens=1)


@dataclass(frozen=True, slots=True)
class GenerateInput:
    """Exactly one of text, token_ids, messages is set."""

    request_id: str = ""
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[ChatMessage, ...] | None = None
    sampling: SamplingParams = SamplingParams()
    priority: int = 0
    chat: ChatOptions = ChatOptions()
    # BOS and the like on top of the prompt; None = a text's default (yes), a chat's (no: the
    # template writes its own)
    add_special_tokens: bool | None = None
    # gen_ai.operation.name; empty = chat for messages, else text_completion
    operation: str = ""
    tools: tuple[dict, ...] | None = None  # OpenAI's, for the chat template (messages only)


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model the replicas serve and their capacity; clients see it without the capacity
    (GetModelInfo, pagedserve.client.ModelInfo)."""

    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    has_chat_template: bool
    # the replica's capacity (0 = not reported)
    block_size: int = 0
    num_gpu_blocks: int = 0
    max_num_seqs: int = 0


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int
    # time.monotonic() when the request reached the gateway: latency metrics count from here
    arrival_s: float = field(default_factory=time.monotonic)
    is_pooling: bool = False  # an embedding request: the prompt pooled, nothing generated
    operation: str = "text_completion"  # gen_ai.operation.name (metrics)


def tokenized(request: GenerateInput, tokenizer: Tokenizer, info: ServedModel
              ) -> tuple[list[int], SamplingParams]:
    """The prompt's ids, and the sampling parameters with their bad words as token ids."""
    return (prompt_token_ids(request, tokenizer, info),
            with_bad_words_token_ids(request.sampling, tokenizer))


def prompt_token_ids(request: GenerateInput, tokenizer: Tokenizer, info: ServedModel
                     ) -> list[int]:
    """Cut to sampling.truncate_prompt_tokens, if set."""
    return truncated_prompt(_all_prompt_token_ids(request, tokenizer, info), request.sampling)


def _all_prompt_token_ids(request: GenerateInput, tokenizer: Tokenizer, info: ServedModel
                          ) -> list[int]:
    if request.text is not None:
        if not request.text:
            raise InvalidRequest("prompt text must not be empty, got ''",
                                 reason=Reason.PROMPT_EMPTY, field="text")
        _check_prompt_chars("prompt text", "text", len(request.text), tokenizer, info)
        return tokenizer.encode(request.text, add_special_tokens=request.add_special_tokens
                                is not False)
    if request.messages is not None:
        if not info.has_chat_template:
            raise InvalidRequest(f"prompt messages need a chat template, but model "
                                 f"{info.model!r} has none; send text or token_ids",
                                 reason=Reason.NO_CHAT_TEMPLATE, field="messages")
        _check_prompt_chars("the messages' content", "messages",
                            sum(len(m.content) for m in request.messages), tokenizer, info)
        options = request.chat
        text = tokenizer.render_chat(
            [m.template_input() for m in request.messages], options.add_generation_prompt,
            options.continue_final_message, options.template_kwargs, request.tools)
        return tokenizer.encode(text, add_special_tokens=bool(request.add_special_tokens))
    if request.token_ids is not None:
        token_ids = list(request.token_ids)
        if not token_ids:
            raise InvalidRequest("prompt token_ids must not be empty, got []",
                                 reason=Reason.PROMPT_EMPTY, field="token_ids")
        check_token_ids("token_ids", token_ids, info.vocab_size, "prompt token_ids")
        return token_ids
    raise InvalidRequest("prompt must be set: one of text, token_ids or messages",
                         reason=Reason.PROMPT_MISSING, field="prompt")


def check_token_ids(field: str, token_ids: list[int], vocab_size: int, what: str) -> None:
    """UNKNOWN_TOKEN_ID with one violation per bad id (the first 8): `field[i]`."""
    bad = [(i, t) for i, t in enumerate(token_ids) if not 0 <= t < vocab_size][:8]
    if bad:
        raise InvalidRequest(
            f"{what} must be in [0, vocab_size={vocab_size}), got {[t for _, t in bad]}",
            reason=Reason.UNKNOWN_TOKEN_ID,
            violations=[FieldViolation(f"{field}[{i}]", f"{t} is not in [0, {vocab_size})")
                        for i, t in bad])


def _check_prompt_chars(what: str, field: str, num_chars: int, tokenizer: Tokenizer,
                        info: ServedModel) -> None:
    """Refuses, before tokenizing it (hundreds of bytes of memory a token), text that cannot
    encode to max_model_len tokens or fewer: no token spans more than max_token_chars characters
    (twice that, for normalizers that merge characters)."""
    limit = 2 * info.max_model_len * tokenizer.max_token_chars
    if num_chars > limit:
        raise InvalidRequest(
            f"{what} must be at most {limit} characters (max_model_len={info.max_model_len} "
            f"tokens of at most {tokenizer.max_token_chars} characters, twice), got {num_chars}",
            reason=Reason.PROMPT_TOO_LONG, field=field,
            metadata={"value": str(num_chars), "limit": str(limit)})


def check_request_id(request_id: str) -> None:
    """Before the id reaches a log: bounded, and printable, so it cannot forge a log line."""
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id must be at most {MAX_REQUEST_ID_CHARS} characters, "
                             f"got {len(request_id)}", reason=Reason.INVALID_REQUEST_ID,
                             field="request_id",
                             metadata={"value": str(len(request_id)),
                                       "limit": str(MAX_REQUEST_ID_CHARS)})
    if not request_id.isprintable():
        raise InvalidRequest(f"request_id must hold printable characters only, got "
                             f"{request_id!r}", reason=Reason.INVALID_REQUEST_ID,
                             field="request_id")


def check_request(request: GenerateInput, info: ServedModel) -> str:
    """Returns the request id, a fresh one if unset."""
    request_id = request.request_id or uuid.uuid4().hex
    check_request_id(request_id)
    if not PRIORITY_RANGE[0] <= request.priority <= PRIORITY_RANGE[1]:
        raise InvalidRequest(f"priority must be in [{PRIORITY_RANGE[0]}, {PRIORITY_RANGE[1]}], "
                             f"got {request.priority}", reason=Reason.INVALID_PRIORITY,
                             field="priority")
    try:
        request.sampling.verify_for_model(info.vocab_size)
    except InvalidRequest as exc:
        raise exc.nested("sampling") from None
    return request_id


def check_structured_outputs(sampling: SamplingParams) -> None:
    """Compiles the constraint without a vocabulary (milliseconds; more for a large schema, so
    the Frontend calls it in its executor)."""
    if sampling.structured_outputs is None:
        return
    try:
        sampling.structured_outputs.verify()
    except InvalidRequest as exc:
        raise exc.nested("sampling") from None


def prepared_request(request: GenerateInput, request_id: str, token_ids: list[int],
                     info: ServedModel, arrival_s: float | None = None) -> PreparedRequest:
    check_context_length(request, len(token_ids), info.max_model_len)
    return PreparedRequest(request_id=request_id, prompt_token_ids=token_ids,
                           sampling=request.sampling,
                           priority=request.priority,
                           arrival_s=time.monotonic() if arrival_s is None else arrival_s,
                           operation=request.operation or (
                               "chat" if request.messages is not None else "text_completion"))


def prompt_field(request: GenerateInput) -> str:
    if request.text is not None:
        return "text"
    return "token_ids" if request.token_ids is not None else "messages"


def check_context_length(request: GenerateInput, num_prompt_tokens: int,
                         max_model_len: int) -> None:
    """prompt + max_tokens must fit max_model_len: PROMPT_TOO_LONG when the prompt leaves no
    room for a single token, else MAX_TOKENS_TOO_LARGE (the client lowers max_tokens)."""
    max_tokens = request.sampling.max_tokens
    num_tokens = num_prompt_tokens + max_tokens
    if num_tokens <= max_model_len:
        return
    message = (f"prompt ({num_prompt_tokens} tokens) + max_tokens ({max_tokens}) must be at "
               f"most max_model_len={max_model_len}, got {num_tokens}")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequest(message, reason=Reason.PROMPT_TOO_LONG, field=prompt_field(request),
                             metadata={"value": str(num_prompt_tokens),
                                       "limit": str(max_model_len - 1)})
    raise InvalidRequest(message, reason=Reason.MAX_TOKENS_TOO_LARGE, field="sampling.max_tokens",
                         metadata={"value": str(max_tokens),
                                   "limit": str(max_model_len - num_prompt_tokens)})


def prepare_request(request: GenerateInput, tokenizer: Tokenizer, info: ServedModel
                    ) -> PreparedRequest:
    """In the caller's thread (tests, tools); the Frontend tokenizes in its thread pool."""
    request_id = check_request(request, info)
    token_ids, sampling = tokenized(request, tokenizer, info)
    return prepared_request(replace(request, sampling=sampling), request_id, token_ids, info)


def template_tool_calls(calls: Sequence[Mapping[str, Any]], index: int
                        ) -> tuple[dict[str, Any], ...]:
    """messages[index]'s tool calls (OpenAI's shape) as chat templates read them: the JSON
    arguments parsed."""
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function")
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"messages[{index}].tool_calls[{j}].function.name must be a "
                                 f"string, got {_brief(call)}", reason=Reason.INVALID_CHAT_MESSAGE,
                                 field=f"messages[{index}].tool_calls[{j}].function.name")
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise InvalidRequest(
                    f"messages[{index}].tool_calls[{j}].function.arguments must be JSON, got "
                    f"{_brief(arguments)}", reason=Reason.INVALID_CHAT_MESSAGE,
                    field=f"messages[{index}].tool_calls[{j}].function.arguments") from None
        checked.append({**call, "type": call.get("type", "function"),
                        "function": {**function, "arguments": arguments}})
    return tuple(checked)


def _brief(value: Any, max_chars: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= max_chars else text[:max_chars] + "..."
