"""What every OpenAI endpoint shares: the Frontend, the served model's name, the usage and
logprob pieces of the responses."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from pagedserve.services.common.outputs import TokenLogprob, Usage
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.openai.errors import ModelNotFound
from pagedserve.services.gateway.openai.protocol import (
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)

MIN_LOGPROB = -9999.0  # JSON has no -inf; OpenAI's clients expect a number


@dataclass(frozen=True, slots=True)
class OpenAIServing:
    frontend: Frontend
    model_name: str
    tool_call_parser: str = ""  # tools.PARSERS' name for `tool_choice: auto`; "" = none
    system_fingerprint: str = field(init=False)

    def __post_init__(self) -> None:
        info = self.frontend.info
        digest = hashlib.sha256(f"{info.model}|{info.architecture}|{info.max_model_len}|"
                                f"{info.vocab_size}".encode()).hexdigest()
        object.__setattr__(self, "system_fingerprint", f"fp_{digest[:10]}")

    def check_model(self, model: str | None) -> None:
        """A request's `model` must be the served name (or absent)."""
        if model is not None and model != self.model_name:
            raise ModelNotFound(f"the model {model!r} does not exist; this server serves "
                                f"{self.model_name!r}", field="model")


def usage_info(usages: Iterable[Usage]) -> UsageInfo:
    """The usage of all a request's prompts together."""
    prompt = completion = cached = 0
    for usage in usages:
        prompt += usage.prompt_tokens
        completion += usage.completion_tokens
        cached += usage.cached_tokens
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion,
                     total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def logprob_value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def token_text(logprob: TokenLogprob) -> str:
    return logprob.text


def token_id_label(logprob: TokenLogprob) -> str:
    """vLLM's name of a token under return_tokens_as_token_ids: one a client cannot confuse
    with another, whatever bytes it decodes to."""
    return f"token_id:{logprob.token_id}"


def token_label(return_tokens_as_token_ids: bool | None) -> Callable[[TokenLogprob], str]:
    return token_id_label if return_tokens_as_token_ids else token_text


def top_logprob(logprob: TokenLogprob,
                label: Callable[[TokenLogprob], str] = token_text) -> TopLogprob:
    token = label(logprob)
    return TopLogprob(token=token, logprob=logprob_value(logprob.logprob),
                      bytes=list(token.encode()))


def prompt_logprobs_body(positions: list[list[TokenLogprob]]) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: None for the first token, then each position's candidates, the
    prompt's own token first."""
    return [None] + [{str(c.token_id): PromptLogprob(logprob=logprob_value(c.logprob),
                                                     decoded_token=c.text)
                      for c in candidates} for candidates in positions]
