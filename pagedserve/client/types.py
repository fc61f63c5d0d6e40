"""The client's requests and results: GenerateRequest built from Python values, and typed
results read from the public API's responses."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.outputs import FinishReason, TokenLogprob, Usage
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.convert_public import (
    finish_reason_from_proto,
    sampling_params_to_proto,
)
from pagedserve.services.rpc.v1 import gateway_pb2

Prompt = str | Sequence[int]  # text, or token ids
Messages = Sequence[Mapping[str, str]]  # [{"role": "user", "content": "..."}, ...]
_SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


@dataclass(slots=True)
class CompletionOutput:
    """One whole output as the client reads it, with its text (the engine's is SequenceDelta)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None
    cumulative_logprob: float = 0.0
    logprobs: list[TokenLogprob] = field(default_factory=list)  # per token, if asked
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # per token, if asked


@dataclass(slots=True)
class Completion:
    request_id: str
    outputs: list[CompletionOutput]  # n of them, by index
    usage: Usage
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)

    @property
    def text(self) -> str:
        return self.outputs[0].text


@dataclass(slots=True)
class StreamDelta:
    """New text and tokens of output `index` as the client reads them (the gateway's is TextDelta);
    its last delta has finish_reason set, and the request's last delta carries usage."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs: list[list[TokenLogprob]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Tokenized:
    token_ids: list[int]
    max_model_len: int


@dataclass(frozen=True, slots=True)
class Embedding:
    request_id: str
    embedding: list[float]  # [hidden_size], L2-normalized
    num_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """GetModelInfo's answer (the gateway's ServedModel without the replicas' capacity)."""

    model: str
    architecture: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    has_chat_template: bool


def sampling_params(sampling: SamplingParams | None, kwargs: Mapping[str, Any]) -> SamplingParams:
    """Either a SamplingParams or its fields as keyword arguments; validated here."""
    unknown = sorted(set(kwargs) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequest(f"unknown sampling parameter(s) {unknown}; the parameters are the "
                             f"fields of SamplingParams")
    if sampling is not None and kwargs:
        raise InvalidRequest(f"pass sampling= or sampling keyword arguments, not both, got "
                             f"{sorted(kwargs)} besides sampling={sampling!r}")
    return sampling if sampling is not None else SamplingParams(**kwargs)


def _set_messages(request: Any, messages: Messages) -> None:
    request.messages.SetInParent()
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping) or not {"role", "content"} <= message.keys():
            raise InvalidRequest(f"messages[{i}] must be a mapping with 'role' and 'content', "
                                 f"got {message!r}")
        request.messages.messages.add(role=message["role"], content=message["content"])


def generate_request(prompt: Prompt | None, messages: Messages | None,
                     sampling: SamplingParams, request_id: str | None,
                     priority: int) -> gateway_pb2.GenerateRequest:
    """The request id is made here when not given, so the caller can abort it at once."""
    request = gateway_pb2.GenerateRequest(request_id=request_id or uuid.uuid4().hex,
                                          priority=priority,
                                          sampling=sampling_params_to_proto(sampling))
    if messages is not None:
        _set_messages(request, messages)
    else:
        _set_prompt(request, prompt)
    return request


def embed_request(prompt: Prompt, request_id: str | None, priority: int
                  ) -> gateway_pb2.EmbedRequest:
    request = gateway_pb2.EmbedRequest(request_id=request_id or uuid.uuid4().hex,
                                       priority=priority)
    _set_prompt(request, prompt)
    return request


def _set_prompt(request: gateway_pb2.GenerateRequest | gateway_pb2.EmbedRequest,
                prompt: Prompt | None) -> None:
    if isinstance(prompt, str):
        request.text = prompt
    elif (isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray)
          and all(isinstance(t, int) for t in prompt)):
        request.token_ids.SetInParent()
        request.token_ids.token_ids.extend(prompt)
    else:
        raise InvalidRequest(f"prompt must be a str or a list of token ids, got {prompt!r}")


def embedding_from_proto(msg: gateway_pb2.EmbedResponse) -> Embedding:
    return Embedding(msg.request_id, list(msg.embedding), msg.num_prompt_tokens)


def stream_request(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateStreamRequest:
    """GenerateStreamRequest has GenerateRequest's fields under the same numbers."""
    return gateway_pb2.GenerateStreamRequest.FromString(request.SerializeToString())


def abort_request(request_id: str) -> gateway_pb2.AbortRequest:
    return gateway_pb2.AbortRequest(request_id=request_id)


def model_info_request() -> gateway_pb2.GetModelInfoRequest:
    return gateway_pb2.GetModelInfoRequest()


def tokenize_request(prompt: str | None, messages: Messages | None
                     ) -> gateway_pb2.TokenizeRequest:
    request = gateway_pb2.TokenizeRequest()
    if messages is not None:
        _set_messages(request, messages)
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        raise InvalidRequest(f"tokenize takes a str prompt or messages, got {prompt!r}")
    return request


def _logprobs(msgs: Any) -> list[TokenLogprob]:
    return [TokenLogprob(m.token_id, m.logprob, m.text) for m in msgs]


def _positions(msgs: Any) -> list[list[TokenLogprob]]:
    return [_logprobs(m.candidates) for m in msgs]


def _usage(msg: Any) -> Usage:
    return Usage(msg.prompt_tokens, msg.completion_tokens, msg.cached_tokens)


def completion_from_proto(msg: gateway_pb2.GenerateResponse) -> Completion:
    outputs = [CompletionOutput(
        index=o.index, text=o.text, token_ids=list(o.token_ids),
        finish_reason=finish_reason_from_proto(o.finish_reason),
        cumulative_logprob=o.cumulative_logprob, logprobs=_logprobs(o.logprobs),
        top_logprobs=_positions(o.top_logprobs)) for o in msg.outputs]
    return Completion(msg.request_id, outputs, _usage(msg.usage),
                      _positions(msg.prompt_logprobs))


def stream_delta_from_proto(msg: gateway_pb2.GenerateStreamResponse) -> StreamDelta:
    return StreamDelta(
        request_id=msg.request_id, index=msg.index, text=msg.text, token_ids=list(msg.token_ids),
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        usage=_usage(msg.usage) if msg.HasField("usage") else None,
        logprobs=_logprobs(msg.logprobs), top_logprobs=_positions(msg.top_logprobs),
        prompt_logprobs=_positions(msg.prompt_logprobs))


def tokenized_from_proto(msg: gateway_pb2.TokenizeResponse) -> Tokenized:
    return Tokenized(list(msg.token_ids), msg.max_model_len)


def model_info_from_proto(msg: gateway_pb2.GetModelInfoResponse) -> ModelInfo:
    return ModelInfo(msg.model, msg.architecture, msg.max_model_len, msg.vocab_size,
                     list(msg.eos_token_ids), msg.has_chat_template)
