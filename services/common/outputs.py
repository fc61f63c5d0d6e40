"""What the engine reports per request: RequestOutput with one CompletionOutput per index, and the
Usage a finished request is billed with.

Plain requests (n == best_of, no beam search) stream: each CompletionOutput carries the tokens
added since the previous report of that index. Beam search and best_of > n report once, when the
request finishes, with the whole output of the n winners (which candidates win is known only
then).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.services.common.step_plan import TokenLogprob


class FinishReason(enum.StrEnum):
    """Why an output ended; the values are what users read (vLLM's words)."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # the client aborted or cancelled
    ERROR = "error"  # the engine failed it; `error` says why


@dataclass(slots=True)
class CompletionOutput:
    index: int
    token_ids: list[int]  # new tokens since the last report (streamed) or the whole output
    logprobs: list[float] = field(default_factory=list)  # one per token in token_ids
    top_logprobs: list[list[TokenLogprob]] = field(default_factory=list)  # if asked, per token
    cumulative_logprob: float = 0.0  # of the whole output so far
    finish_reason: FinishReason | None = None  # None while running
    error: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    finished: bool
    num_prompt_tokens: int
    num_cached_tokens: int
    # positions 1.. of the prompt (None where the KV came from the prefix cache); first report only
    prompt_logprobs: list[list[TokenLogprob] | None] | None = None


@dataclass(frozen=True, slots=True)
class Usage:
    """Token counts of one request (all n outputs together); the twin of common.proto's Usage."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
