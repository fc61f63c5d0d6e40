"""Converters for the internal contract's common.proto (pagedserve.internal.v1), which the
scheduler and the worker share; the cores never see protobuf. convert_public.py is the public
API's twin and reuses the field lists and readers here, which work on either SamplingParams."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from google.protobuf.internal.containers import RepeatedCompositeFieldContainer
from google.protobuf.message import Message
from pagedserve.services.common.errors import InvalidRequest, Reason
from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.rpc.internal.v1 import common_pb2

# `optional` in the proto: unset means "vLLM's default", which differs from the zero value.
_OPTIONAL_FIELDS = ("n", "best_of", "length_penalty", "temperature", "top_p", "repetition_penalty",
                    "seed", "max_tokens", "logprobs", "prompt_logprobs", "skip_special_tokens")
# plain in the proto: the zero value is vLLM's default.
_PLAIN_FIELDS = ("use_beam_search", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                 "include_stop_str_in_output", "ignore_eos", "min_tokens")



class FinishReasonCodec:
    """FinishReason to and from one contract's proto enum (both contracts name their values
    FINISH_REASON_<NAME>; None is UNSPECIFIED)."""

    def __init__(self, enum_type) -> None:
        self._unspecified = enum_type.Value("FINISH_REASON_UNSPECIFIED")
        self._to_proto = {reason: enum_type.Value(f"FINISH_REASON_{reason.name}")
                          for reason in FinishReason}
        self._from_proto = {value: reason for reason, value in self._to_proto.items()}

    def to_proto(self, reason: FinishReason | None) -> int:
        if reason is None:
            return self._unspecified
        try:
            return self._to_proto[reason]
        except KeyError:
            raise ValueError(f"finish reason must be one of {[r.value for r in FinishReason]} "
                             f"or None, got {reason!r}") from None

    def from_proto(self, value: int) -> FinishReason | None:
        if value == self._unspecified:
            return None
        try:
            return self._from_proto[value]
        except KeyError:
            raise ValueError(f"unknown FinishReason value {value}") from None


_FINISH_REASONS = FinishReasonCodec(common_pb2.FinishReason)
finish_reason_to_proto = _FINISH_REASONS.to_proto
finish_reason_from_proto = _FINISH_REASONS.from_proto


def _set(msg: Message, name: str, value: object) -> None:
    try:
        setattr(msg, name, value)
    except (TypeError, ValueError) as e:  # out of the proto field's range (int32, int64, ...)
        raise InvalidRequest(f"{name} is out of range, got {value!r}",
                             reason=Reason.INVALID_SAMPLING_PARAMS, field=name) from e


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    fill_sampling_params(msg, params)
    return msg


def fill_sampling_params(msg: Message, params: SamplingParams) -> None:
    """Into a SamplingParams message of either contract. Fields left None stay unset, so the
    receiver applies the same defaults."""
    for name in _OPTIONAL_FIELDS + _PLAIN_FIELDS:
        value = getattr(params, name)
        if value is not None:
            _set(msg, name, value)
    msg.stop.extend(params.stop)
    _extend_ids(msg.stop_token_ids, "stop_token_ids", params.stop_token_ids)
    _extend_ids(msg.allowed_token_ids, "allowed_token_ids", params.allowed_token_ids or ())
    if params.structured_outputs is not None:
        fill_structured_outputs(msg.structured_outputs, params.structured_outputs)
    try:
        msg.logit_bias.update(params.logit_bias)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"logit_bias is out of range, got {dict(params.logit_bias)}",
                             reason=Reason.INVALID_SAMPLING_PARAMS, field="logit_bias") from e
    fields = msg.DESCRIPTOR.fields_by_name
    if "bad_words" in fields:  # the public contract: the words; the internal one: their tokens
        msg.bad_words.extend(params.bad_words)
        if params.truncate_prompt_tokens is not None:
            _set(msg, "truncate_prompt_tokens", params.truncate_prompt_tokens)
    else:
        for ids in params.bad_words_token_ids:
            msg.bad_words_token_ids.add().token_ids.extend(ids)


def _extend_ids(container, name: str, ids) -> None:
    try:
        container.extend(ids)
    except (TypeError, ValueError) as e:
        raise InvalidRequest(f"{name} is out of range, got {list(ids)}",
                             reason=Reason.INVALID_SAMPLING_PARAMS, field=name) from e


def sampling_params_from_proto(msg: Message) -> SamplingParams:
    """From a SamplingParams message of either contract (the same fields)."""
    kwargs = {name: getattr(msg, name) for name in _PLAIN_FIELDS}
    kwargs.update({name: getattr(msg, name) for name in _OPTIONAL_FIELDS if msg.HasField(name)})
    if "bad_words" in msg.DESCRIPTOR.fields_by_name:
        kwargs["bad_words"] = tuple(msg.bad_words)
        if msg.HasField("truncate_prompt_tokens"):
            kwargs["truncate_prompt_tokens"] = msg.truncate_prompt_tokens
    else:
        kwargs["bad_words_token_ids"] = tuple(tuple(w.token_ids) for w in msg.bad_words_token_ids)
    if msg.HasField("structured_outputs"):
        kwargs["structured_outputs"] = structured_outputs_from_proto(msg.structured_outputs)
    return SamplingParams(stop=tuple(msg.stop), stop_token_ids=tuple(msg.stop_token_ids),
                          logit_bias=dict(msg.logit_bias),
                          allowed_token_ids=tuple(msg.allowed_token_ids) or None, **kwargs)


def fill_structured_outputs(msg: Message, params: StructuredOutputsParams) -> None:
    if params.choice is not None:
        msg.choice.choices.extend(params.choice)
    else:
        setattr(msg, params.kind, getattr(params, params.kind))


def structured_outputs_from_proto(msg: Message) -> StructuredOutputsParams:
    kind = msg.WhichOneof("constraint")
    if kind is None or (kind == "json_object" and not msg.json_object):
        raise InvalidRequest("sampling.structured_outputs must set one of json_schema, "
                             "json_object (true), regex, choice, grammar",
                             reason=Reason.INVALID_SAMPLING_PARAMS,
                             field="structured_outputs")
    if kind == "choice":
        return StructuredOutputsParams(choice=tuple(msg.choice.choices))
    return StructuredOutputsParams(**{kind: getattr(msg, kind)})


def token_logprob_to_proto(logprob: TokenIdLogprob) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=logprob.token_id, logprob=logprob.logprob)


def token_logprob_from_proto(msg: common_pb2.TokenLogprob) -> TokenIdLogprob:
    return TokenIdLogprob(token_id=msg.token_id, logprob=msg.logprob)


def token_logprobs_to_proto(candidates: Iterable[TokenIdLogprob]) -> common_pb2.TokenLogprobs:
    msg = common_pb2.TokenLogprobs()
    for c in candidates:
        msg.candidates.add(token_id=c.token_id, logprob=c.logprob)
    return msg


def token_logprobs_from_proto(msg: common_pb2.TokenLogprobs) -> list[TokenIdLogprob]:
    return [TokenIdLogprob(token_id=c.token_id, logprob=c.logprob) for c in msg.candidates]


def add_logprob_lists(container: RepeatedCompositeFieldContainer[common_pb2.TokenLogprobs],
                      positions: Sequence[Sequence[TokenIdLogprob]]) -> None:
    for candidates in positions:
        position = container.add()
        for c in candidates:
            position.candidates.add(token_id=c.token_id, logprob=c.logprob)


def logprob_lists_from_proto(container: Iterable[common_pb2.TokenLogprobs]) -> list[list[TokenIdLogprob]]:
    if not container:
        return []
    return [token_logprobs_from_proto(position) for position in container]
