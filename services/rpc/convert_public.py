"""Converters for the public API's common.proto (pagedserve.v1): what the gateway and clients put
on the wire. The gateway reads a public SamplingParams into the dataclass and writes the internal
one from it (convert_common.py), so the two contracts never exchange messages."""

from __future__ import annotations

from pagedserve.services.common.outputs import Usage
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.convert_common import (
    FinishReasonCodec,
    fill_sampling_params,
    sampling_params_from_proto,
)
from pagedserve.services.rpc.v1 import common_pb2

__all__ = ["finish_reason_from_proto", "finish_reason_to_proto", "sampling_params_from_proto",
           "sampling_params_to_proto", "usage_from_proto", "usage_to_proto"]

_FINISH_REASONS = FinishReasonCodec(common_pb2.FinishReason)
finish_reason_to_proto = _FINISH_REASONS.to_proto
finish_reason_from_proto = _FINISH_REASONS.from_proto


def sampling_params_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams()
    fill_sampling_params(msg, params)
    return msg



def usage_to_proto(usage: Usage) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=usage.prompt_tokens,
                            completion_tokens=usage.completion_tokens,
                            cached_tokens=usage.cached_tokens)


def usage_from_proto(msg: common_pb2.Usage) -> Usage:
    return Usage(prompt_tokens=msg.prompt_tokens, completion_tokens=msg.completion_tokens,
                 cached_tokens=msg.cached_tokens)
