"""gateway.proto (and scheduler.proto's GetServedModelResponse) ↔ the gateway's dataclasses: the
only place they meet. Free functions, one pair per message."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from pagedserve.services.common.config import served_model_name
from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.outputs import TokenLogprob
from pagedserve.services.gateway.validation import (
    EMBED_SAMPLING,
    ChatMessage,
    ChatOptions,
    GenerateInput,
    ServedModel,
    template_tool_calls,
)
from pagedserve.services.rpc.convert_public import (
    finish_reason_from_proto,
    finish_reason_to_proto,
    sampling_params_from_proto,
    sampling_params_to_proto,
    usage_from_proto,
    usage_to_proto,
)
from pagedserve.services.rpc.internal.v1 import scheduler_pb2
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2
from pagedserve.services.text.text_stream import TextDelta


def _messages_from_proto(msg: common_pb2.ChatMessages) -> tuple[ChatMessage, ...]:
    return tuple(
        ChatMessage(role=m.role, content=m.content, tool_call_id=m.tool_call_id, name=m.name,
                    tool_calls=template_tool_calls([_tool_call(c) for c in m.tool_calls], i))
        for i, m in enumerate(msg.messages))


def _tool_call(call: common_pb2.ChatToolCall) -> dict[str, Any]:
    """OpenAI's shape, which chat templates read."""
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments or "{}"}}


def _chat_options_from_proto(msg: common_pb2.ChatMessages) -> ChatOptions:
    kwargs: Any = {}
    if msg.chat_template_kwargs:
        try:
            kwargs = json.loads(msg.chat_template_kwargs)
        except ValueError:
            kwargs = None
        if not isinstance(kwargs, dict):
            raise InvalidRequest(
                f"chat_template_kwargs must be a JSON object, got {msg.chat_template_kwargs[:80]!r}",
                reason=Reason.INVALID_CHAT_MESSAGE, field="chat_template_kwargs")
    add_generation_prompt = (msg.add_generation_prompt if msg.HasField("add_generation_prompt")
                             else True)
    return ChatOptions(add_generation_prompt=add_generation_prompt,
                       continue_final_message=msg.continue_final_message, template_kwargs=kwargs)


# GenerateInput's fields that sit one message deeper in the proto (TokenIds, ChatMessages)
_WRAPPED_FIELDS = {"token_ids": "token_ids.token_ids", "messages": "messages.messages",
                   "chat_template_kwargs": "messages.chat_template_kwargs"}


def proto_field_path(path: str) -> str:
    """A GenerateInput field path ("token_ids[3]", "messages[0].role") as the path of the same
    field in GenerateRequest / TokenizeRequest ("token_ids.token_ids[3]"); a tool call's
    "function.arguments" is its ChatToolCall's "arguments"."""
    for name, proto_path in _WRAPPED_FIELDS.items():
        if path == name or path.startswith((f"{name}[", f"{name}.")):
            return (proto_path + path[len(name):]).replace(".function.", ".")
    return path


def generate_request_from_proto(msg: gateway_pb2.GenerateRequest | gateway_pb2.GenerateStreamRequest
                                ) -> GenerateInput:
    """Either request: GenerateStreamRequest has GenerateRequest's fields, same numbers."""
    prompt = msg.WhichOneof("prompt")
    try:
        sampling = sampling_params_from_proto(msg.sampling)
    except InvalidRequest as exc:
        raise exc.nested("sampling") from None
    return GenerateInput(
        request_id=msg.request_id,
        text=msg.text if prompt == "text" else None,
        token_ids=tuple(msg.token_ids.token_ids) if prompt == "token_ids" else None,
        messages=_messages_from_proto(msg.messages) if prompt == "messages" else None,
        chat=_chat_options_from_proto(msg.messages) if prompt == "messages" else ChatOptions(),
        sampling=sampling, priority=msg.priority)


def embed_request_from_proto(msg: gateway_pb2.EmbedRequest) -> GenerateInput:
    prompt = msg.WhichOneof("prompt")
    return GenerateInput(
        request_id=msg.request_id, text=msg.text if prompt == "text" else None,
        token_ids=tuple(msg.token_ids.token_ids) if prompt == "token_ids" else None,
        sampling=EMBED_SAMPLING, priority=msg.priority)


def generate_request_to_proto(request: GenerateInput) -> gateway_pb2.GenerateRequest:
    msg = gateway_pb2.GenerateRequest(request_id=request.request_id, priority=request.priority,
                                      sampling=sampling_params_to_proto(request.sampling))
    if request.text is not None:
        msg.text = request.text
    elif request.token_ids is not None:
        msg.token_ids.SetInParent()
        msg.token_ids.token_ids.extend(request.token_ids)
    elif request.messages is not None:
        msg.messages.SetInParent()
        for m in request.messages:
            msg.messages.messages.add(
                role=m.role, content=m.content, tool_call_id=m.tool_call_id, name=m.name,
                tool_calls=[common_pb2.ChatToolCall(
                    id=c.get("id", ""), name=c["function"]["name"],
                    arguments=json.dumps(c["function"]["arguments"])) for c in m.tool_calls])
        chat = request.chat
        if chat.template_kwargs:
            msg.messages.chat_template_kwargs = json.dumps(dict(chat.template_kwargs))
        msg.messages.add_generation_prompt = chat.add_generation_prompt
        msg.messages.continue_final_message = chat.continue_final_message
    return msg


def _logprob_to_proto(logprob: TokenLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob,
                                   text=logprob.text)


def _logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(token_id=msg.token_id, logprob=msg.logprob, text=msg.text)


def _positions_to_proto(positions: Sequence[Sequence[TokenLogprob]]
                        ) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(candidates=[_logprob_to_proto(c) for c in p])
            for p in positions]


def _positions_from_proto(msgs: Sequence[common_pb2.TokenLogprobs]) -> list[list[TokenLogprob]]:
    return [[_logprob_from_proto(c) for c in p.candidates] for p in msgs]


def text_delta_to_proto(delta: TextDelta, request_id: str
                          ) -> gateway_pb2.GenerateStreamResponse:
    """cumulative_logprob and error are not on the wire per delta: the unary response and the
    status message carry them."""
    msg = gateway_pb2.GenerateStreamResponse(
        request_id=request_id, index=delta.index, text=delta.text, token_ids=delta.token_ids)
    if delta.finish_reason is not None:
        msg.finish_reason = finish_reason_to_proto(delta.finish_reason)
    if delta.logprobs:
        msg.logprobs.extend(_logprob_to_proto(lp) for lp in delta.logprobs)
    if delta.top_logprobs:
        msg.top_logprobs.extend(_positions_to_proto(delta.top_logprobs))
    if delta.usage is not None:
        msg.usage.CopyFrom(usage_to_proto(delta.usage))
    if delta.prompt_logprobs is not None:
        msg.prompt_logprobs.extend(_positions_to_proto(delta.prompt_logprobs))
    return msg


def text_delta_from_proto(msg: gateway_pb2.GenerateStreamResponse) -> TextDelta:
    return TextDelta(
        index=msg.index, text=msg.text, token_ids=list(msg.token_ids),
        logprobs=[_logprob_from_proto(lp) for lp in msg.logprobs],
        top_logprobs=_positions_from_proto(msg.top_logprobs),
        finish_reason=finish_reason_from_proto(msg.finish_reason),
        usage=usage_from_proto(msg.usage) if msg.HasField("usage") else None,
        prompt_logprobs=_positions_from_proto(msg.prompt_logprobs) or None)


def generate_response_to_proto(request_id: str, deltas: Sequence[TextDelta], n: int
                               ) -> gateway_pb2.GenerateResponse:
    """The outputs that finished: beam search under a constraint that admits fewer completions
    than n reports fewer outputs."""
    outputs = [gateway_pb2.CompletionOutput(index=i) for i in range(n)]
    msg = gateway_pb2.GenerateResponse(request_id=request_id)
    for delta in deltas:
        out = outputs[delta.index]
        out.text += delta.text
        out.token_ids.extend(delta.token_ids)
        out.logprobs.extend(_logprob_to_proto(lp) for lp in delta.logprobs)
        out.top_logprobs.extend(_positions_to_proto(delta.top_logprobs))
        out.cumulative_logprob = delta.cumulative_logprob
        if delta.finish_reason is not None:
            out.finish_reason = finish_reason_to_proto(delta.finish_reason)
        if delta.usage is not None:
            msg.usage.CopyFrom(usage_to_proto(delta.usage))
        if delta.prompt_logprobs is not None:
            msg.prompt_logprobs.extend(_positions_to_proto(delta.prompt_logprobs))
    msg.outputs.extend(out for out in outputs if out.finish_reason)
    return msg


def tokenize_request_from_proto(msg: gateway_pb2.TokenizeRequest) -> GenerateInput:
    prompt = msg.WhichOneof("prompt")
    if prompt is None:
        raise InvalidRequest("prompt must be set: one of text or messages",
                             reason=Reason.PROMPT_MISSING, field="prompt")
    if prompt == "text":
        return GenerateInput(text=msg.text)
    return GenerateInput(messages=_messages_from_proto(msg.messages),
                         chat=_chat_options_from_proto(msg.messages))


def tokenize_response_to_proto(token_ids: Sequence[int], max_model_len: int
                               ) -> gateway_pb2.TokenizeResponse:
    return gateway_pb2.TokenizeResponse(token_ids=token_ids, max_model_len=max_model_len)


def served_model_to_info_proto(info: ServedModel) -> gateway_pb2.GetModelInfoResponse:
    """The replica's capacity stays inside: clients see the model, not the deployment."""
    return gateway_pb2.GetModelInfoResponse(
        model=info.model, architecture=info.architecture, max_model_len=info.max_model_len,
        vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
        has_chat_template=info.has_chat_template)


def served_model_from_info_proto(msg: gateway_pb2.GetModelInfoResponse) -> ServedModel:
    return ServedModel(
        model=msg.model, architecture=msg.architecture, max_model_len=msg.max_model_len,
        vocab_size=msg.vocab_size, eos_token_ids=tuple(msg.eos_token_ids),
        has_chat_template=msg.has_chat_template)


def served_model_from_proto(msg: scheduler_pb2.GetServedModelResponse, has_chat_template: bool
                                 ) -> ServedModel:
    return ServedModel(model=msg.served_model_name or served_model_name(msg.model),
                       architecture=msg.architecture,
                       max_model_len=msg.max_model_len, vocab_size=msg.vocab_size,
                       eos_token_ids=tuple(msg.eos_token_ids),
                       has_chat_template=has_chat_template, block_size=msg.block_size,
                       num_gpu_blocks=msg.num_gpu_blocks, max_num_seqs=msg.max_num_seqs)

