"""The OpenAI (and vLLM-extension) request and response bodies, as pydantic models.

Requests keep the fields they do not declare (`model_extra`): request_fields.py refuses those
vLLM serves and this server does not, and logs the others once, as vLLM ignores them. Values
that need the model or the sampling rules are checked later (convert.py, SamplingParams) with
messages naming the field. `None` means "the default" for every optional field, since clients
send explicit nulls.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pagedserve.services.common.sampling_params import MAX_LOGPROBS
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
)

# --- requests ---------------------------------------------------------------------------------


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # refused when true (convert.py)


class GenerationRequest(BaseModel):
    """Fields /v1/completions and /v1/chat/completions share: OpenAI's, then vLLM's extras."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    request_id: str | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=1)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    return_tokens_as_token_ids: bool | None = None  # logprobs name tokens "token_id:<id>"
    # structured outputs (openai/structured.py): OpenAI's, vLLM's, vLLM's older guided_*
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[Any]  # text, texts, token ids or lists of token ids: checked in convert
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None  # parts: checked in convert
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message's answer to one


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    echo: bool = False  # the answer starts with the last message when it is the assistant's
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt or chat messages."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = None
    add_special_tokens: bool = True  # a prompt's; messages get the template's own
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


# --- responses --------------------------------------------------------------------------------


def now_s() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's form of one candidate at a prompt position."""

    logprob: float | None
    decoded_token: str


# per prompt position (None for the first): token id → its logprob, the prompt's token first
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _prompt_logprobs_if_asked(self, handler: SerializerFunctionWrapHandler
                                  ) -> dict[str, Any]:
        body = handler(self)
        if body.get("prompt_logprobs") is None:
            body.pop("prompt_logprobs", None)
        return body


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionCallDelta(BaseModel):
    name: str | None = None  # in a call's first delta
    arguments: str | None = None  # the arguments' text generated since the last delta

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ToolCallDelta(BaseModel):
    """A call's first delta carries its id, type and name; the later ones its arguments."""

    index: int  # the call's place in the choice's tool_calls
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None

    @model_serializer(mode="wrap")
    def _without_no_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k != "tool_calls" or v is not None}


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None

    @model_serializer(mode="wrap")
    def _prompt_logprobs_if_asked(self, handler: SerializerFunctionWrapHandler
                                  ) -> dict[str, Any]:
        body = handler(self)
        if body.get("prompt_logprobs") is None:
            body.pop("prompt_logprobs", None)
        return body


class ChatDelta(BaseModel):
    """Only the fields a chunk changes: the role once, then content and tool calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer(mode="wrap")
    def _without_nulls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "pagedserve"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
