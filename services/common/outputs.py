"""What the engine reports per request. Plain requests stream (each SequenceDelta carries the
tokens since the last report); beam search and best_of > n report the n winners once, at the end.
Usage and TokenLogprob are what a caller sees of them, in the gateway and in the client.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.services.common.step_plan import TokenIdLogprob


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client aborted or cancelled
    ERROR = "error"  # the engine failed it; `error` says why


@dataclass(slots=True)
class SequenceDelta:
    """One output's tokens as the engine reports them, without text (the wire's SequenceDelta);
    callers see pagedserve.client.CompletionOutput."""

    index: int
    token_ids: list[int]  # new tokens since the last report (streamed) or the whole output
    logprobs: list[float] = field(default_factory=list)  # one per token in token_ids
    top_logprobs: list[list[TokenIdLogprob]] = field(default_factory=list)  # if asked, per token
    cumulative_logprob: float = 0.0  # of the whole output so far
    finish_reason: FinishReason | None = None
    error: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    outputs: list[SequenceDelta]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    # positions 1.. of the prompt (None where the KV came from the prefix cache); first report only
    prompt_logprobs: list[list[TokenIdLogprob] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's pooled vector, at its end


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """A token's logprob with its text, as the gateway sends it and the client reads it."""

    token_id: int
    logprob: float
    text: str


@dataclass(frozen=True, slots=True)
class Usage:
    """Of one request, all n outputs together."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
