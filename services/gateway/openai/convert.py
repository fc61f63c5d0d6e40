"""OpenAI request bodies → the gateway's GenerateInput and SamplingParams.

Problems raise InvalidRequest naming the field and the value, as the gRPC door does; the sampling
rules themselves are SamplingParams' (one place), so its messages reach HTTP clients unchanged.
"""

from __future__ import annotations

from typing import Any

from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.gateway.config import RequestLimitsConfig
from pagedserve.services.gateway.limits import (
    check_list_lengths,
    check_num_prompts,
    check_num_token_ids,
    check_token_ids_bytes,
)
from pagedserve.services.gateway.openai.protocol import (
    ChatCompletionRequest,
    ChatMessageIn,
    CompletionRequest,
    GenerationRequest,
    TokenizeRequest,
)
from pagedserve.services.gateway.openai.request_fields import (
    REFUSED_CHAT_FIELDS,
    REFUSED_COMPLETION_FIELDS,
    check_undeclared_fields,
)
from pagedserve.services.gateway.openai.structured import structured_outputs
from pagedserve.services.gateway.validation import (
    ChatMessage,
    ChatOptions,
    GenerateInput,
    ServedModel,
    template_tool_calls,
)

_PROMPT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _brief(value: Any, max_chars: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= max_chars else text[:max_chars] + "..."


def _reject_unsupported(request: GenerationRequest) -> None:
    is_chat = isinstance(request, ChatCompletionRequest)
    check_undeclared_fields(request, REFUSED_CHAT_FIELDS if is_chat
                            else REFUSED_COMPLETION_FIELDS)
    if request.stream_options is not None and request.stream_options.continuous_usage_stats:
        raise InvalidRequest("stream_options.continuous_usage_stats is not supported, got true",
                             reason=Reason.UNSUPPORTED_PARAMETER,
                             field="stream_options.continuous_usage_stats")
    if request.prompt_logprobs and request.stream:
        raise InvalidRequest(f"prompt_logprobs are not available when stream=true, got "
                             f"prompt_logprobs={request.prompt_logprobs}",
                             reason=Reason.INVALID_SAMPLING_PARAMS, field="prompt_logprobs")
    if isinstance(request, CompletionRequest) and request.suffix:
        raise InvalidRequest(f"suffix is not supported, got {_brief(request.suffix)}",
                             reason=Reason.UNSUPPORTED_PARAMETER, field="suffix")


def sampling_params(request: GenerationRequest, max_tokens: int | None,
                    logprobs: int | None, prompt_logprobs: int | None = None,
                    limits: RequestLimitsConfig | None = None,
                    constraint: StructuredOutputsParams | None = None) -> SamplingParams:
    """Fields left unset (or null) keep SamplingParams' defaults; the stop lists are bounded by
    `limits` (default: the config's defaults) before anything scans them. `constraint`: the
    tool calls' (chat), else the request's structured-output fields'."""
    _reject_unsupported(request)
    stop = [request.stop] if isinstance(request.stop, str) else request.stop
    check_list_lengths(stop or (), request.stop_token_ids or (),
                       limits if limits is not None else RequestLimitsConfig())
    if prompt_logprobs is None:
        prompt_logprobs = request.prompt_logprobs
    values: dict[str, Any] = {
        "n": request.n, "best_of": request.best_of, "use_beam_search": request.use_beam_search,
        "length_penalty": request.length_penalty, "temperature": request.temperature,
        "top_p": request.top_p, "top_k": request.top_k, "min_p": request.min_p,
        "presence_penalty": request.presence_penalty,
        "frequency_penalty": request.frequency_penalty,
        "repetition_penalty": request.repetition_penalty, "seed": request.seed, "stop": stop,
        "stop_token_ids": request.stop_token_ids,
        "include_stop_str_in_output": request.include_stop_str_in_output,
        "ignore_eos": request.ignore_eos, "max_tokens": max_tokens,
        "min_tokens": request.min_tokens, "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs, "skip_special_tokens": request.skip_special_tokens,
        "logit_bias": _logit_bias(request.logit_bias),
        "allowed_token_ids": request.allowed_token_ids, "bad_words": request.bad_words,
        "truncate_prompt_tokens": request.truncate_prompt_tokens,
        "structured_outputs": _constraint(request, constraint)}
    return SamplingParams(**{k: v for k, v in values.items() if v is not None})


def _logit_bias(logit_bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON keys are strings; each must spell a token id."""
    if not logit_bias:
        return None
    bias = {}
    for key, value in logit_bias.items():
        if not key.isdigit():
            raise InvalidRequest(f"logit_bias keys must be token ids, got {_brief(key)}",
                                 reason=Reason.INVALID_SAMPLING_PARAMS, field="logit_bias")
        bias[int(key)] = value
    return bias


def _constraint(request: GenerationRequest, tool_constraint: StructuredOutputsParams | None
                ) -> StructuredOutputsParams | None:
    requested = structured_outputs(request)
    if tool_constraint is not None and requested is not None:
        raise InvalidRequest("tool_choice required or a named function constrains the output to "
                             "tool calls; it cannot be combined with response_format, "
                             "structured_outputs or guided_* fields",
                             reason=Reason.INVALID_SAMPLING_PARAMS, field="tool_choice")
    return tool_constraint or requested


def check_prompt_size(prompt: str | list[Any], sampling: SamplingParams,
                      limits: RequestLimitsConfig, info: ServedModel) -> None:
    """Before the prompt's elements are scanned: how many prompts (a list of texts or of id
    lists) and how many ids each, by the lengths alone."""
    if isinstance(prompt, str) or not prompt:
        return
    if _is_token_id(prompt[0]):
        check_num_token_ids("prompt", len(prompt), info)
        return
    check_num_prompts(len(prompt), sampling, limits, info)
    num_token_ids = 0
    for i, one in enumerate(prompt):
        if isinstance(one, list):
            check_num_token_ids(f"prompt[{i}]", len(one), info)
            num_token_ids += len(one)
    check_token_ids_bytes("prompt", num_token_ids, limits)


def completion_prompts(prompt: str | list[Any]) -> list[GenerateInput]:
    """One input per prompt: text, texts, token ids, or token-id lists (sampling set later)."""
    if isinstance(prompt, str):
        return [GenerateInput(text=prompt)]
    if not prompt:
        raise InvalidRequest("prompt must not be empty, got []", reason=Reason.PROMPT_EMPTY,
                             field="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [GenerateInput(text=p) for p in prompt]
    if all(_is_token_id(t) for t in prompt):
        return [GenerateInput(token_ids=tuple(prompt))]
    if all(isinstance(p, list) and all(_is_token_id(t) for t in p) for p in prompt):
        return [GenerateInput(token_ids=tuple(p)) for p in prompt]
    raise InvalidRequest(f"prompt must be {_PROMPT_SHAPES}, got {_brief(prompt)}",
                         reason=Reason.INVALID_PROMPT, field="prompt")


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def chat_messages(messages: list[ChatMessageIn]) -> tuple[ChatMessage, ...]:
    """String content as is; a list of parts must hold text parts only, joined by newlines. An
    assistant's tool calls go to the template with their JSON arguments parsed, as templates
    read them."""
    return tuple(ChatMessage(role=m.role, content=_message_text(m.content, i),
                             tool_calls=template_tool_calls(m.tool_calls or [], i),
                             tool_call_id=m.tool_call_id or "", name=m.name or "")
                 for i, m in enumerate(messages))


def chat_options(request: ChatCompletionRequest | TokenizeRequest) -> ChatOptions:
    return ChatOptions(add_generation_prompt=request.add_generation_prompt,
                       continue_final_message=request.continue_final_message,
                       template_kwargs=request.chat_template_kwargs or {})


def _message_text(content: str | list[dict[str, Any]] | None, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind != "text":
            raise InvalidRequest(f"messages[{index}].content[{j}].type must be 'text' (the only "
                                 f"content part served), got {_brief(kind)}",
                                 reason=Reason.INVALID_CHAT_MESSAGE,
                                 field=f"messages[{index}].content[{j}].type")
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidRequest(f"messages[{index}].content[{j}].text must be a string, got "
                                 f"{_brief(text)}", reason=Reason.INVALID_CHAT_MESSAGE,
                                 field=f"messages[{index}].content[{j}].text")
        texts.append(text)
    return "\n".join(texts)


def chat_top_logprobs(request: ChatCompletionRequest) -> int | None:
    """SamplingParams.logprobs for a chat request: top_logprobs needs logprobs=true."""
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequest(f"top_logprobs needs logprobs=true, got top_logprobs="
                             f"{request.top_logprobs} with logprobs=false",
                             reason=Reason.INVALID_SAMPLING_PARAMS, field="top_logprobs")
    return (request.top_logprobs or 0) if request.logprobs else None


def chat_requested_max_tokens(request: ChatCompletionRequest) -> int | None:
    """max_completion_tokens, else max_tokens, else None (what the prompt leaves)."""
    if request.max_completion_tokens is not None:
        if request.max_completion_tokens < 1:
            raise InvalidRequest(f"max_completion_tokens must be at least 1, got "
                                 f"{request.max_completion_tokens}",
                                 reason=Reason.INVALID_SAMPLING_PARAMS,
                                 field="max_completion_tokens")
        return request.max_completion_tokens
    return request.max_tokens


def chat_max_tokens(request: ChatCompletionRequest, num_prompt_tokens: int,
                    info: ServedModel) -> int:
    """The requested max tokens, else what the context leaves, and what the replica's KV cache
    leaves each of the request's sequences when it reports its size (at least 1, so a prompt
    that fills either fails on the length check naming both)."""
    requested = chat_requested_max_tokens(request)
    if requested is not None:
        return requested
    room = info.max_model_len - num_prompt_tokens
    if info.num_gpu_blocks and info.block_size:
        num_seqs = max(request.best_of or 1, request.n or 1)
        cache_tokens = info.num_gpu_blocks * info.block_size // num_seqs
        room = min(room, cache_tokens - num_prompt_tokens - info.block_size)
    return max(1, room)
