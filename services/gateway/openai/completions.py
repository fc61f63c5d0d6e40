"""POST /v1/completions: one or many prompts, n choices each (choice index = prompt index * n +
output index), streamed as `text_completion` chunks or returned whole."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator

from pagedserve.services.common.outputs import Usage
from pagedserve.services.gateway.openai import sse
from pagedserve.services.gateway.openai.convert import (
    check_prompt_size,
    completion_prompts,
    sampling_params,
)
from pagedserve.services.gateway.openai.errors import error_for
from pagedserve.services.gateway.openai.generation import (
    StartedDeltas,
    Submission,
    respond,
)
from pagedserve.services.gateway.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    now_s,
)
from pagedserve.services.gateway.openai.serving import (
    OpenAIServing,
    logprob_value,
    usage_info,
)
from pagedserve.services.text.text_stream import TextDelta
from starlette.requests import Request
from starlette.responses import Response


@dataclasses.dataclass(slots=True)
class _Choice:
    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    num_chars: int = 0  # of the token texts so far: the next token's text_offset


def _logprobs(delta: TextDelta, choice: _Choice) -> CompletionLogprobs:
    """The sampled token's logprob, and the top candidates with the sampled one among them."""
    out = CompletionLogprobs()
    for i, sampled in enumerate(delta.logprobs):
        out.tokens.append(sampled.text)
        out.token_logprobs.append(logprob_value(sampled.logprob))
        top = {c.text: logprob_value(c.logprob)
               for c in (delta.top_logprobs[i] if i < len(delta.top_logprobs) else ())}
        top.setdefault(sampled.text, logprob_value(sampled.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(choice.num_chars)
        choice.num_chars += len(sampled.text)
    return out


class _Completion:
    """Built in two steps: the inputs (`__init__`, whose cost is bounded by their lengths
    alone), then, once they are admitted and prepared, what is kept per output (`start`)."""

    def __init__(self, serving: OpenAIServing, body: CompletionRequest) -> None:
        serving.check_model(body.model)
        self.serving = serving
        self.body = body
        self.id = f"cmpl-{uuid.uuid4().hex}"
        self.created = now_s()
        frontend = serving.frontend
        sampling = sampling_params(body, body.max_tokens, body.logprobs, limits=frontend.limits)
        check_prompt_size(body.prompt, sampling, frontend.limits, frontend.info)
        prompts = completion_prompts(body.prompt)
        self.inputs = [dataclasses.replace(
            p, sampling=sampling, priority=body.priority,
            request_id=self.id if len(prompts) == 1 else f"{self.id}-{i}")
            for i, p in enumerate(prompts)]
        self.n = sampling.n
        self.echoes: list[str] = []
        self.choices: list[_Choice] = []
        self.usages: list[Usage] = []

    async def start(self, submission: Submission) -> None:
        """Echoed token ids are decoded off the event loop, once prepare checked them."""
        for one, prepared in zip(self.inputs, submission.prepared, strict=True):
            if not self.body.echo:
                self.echoes.append("")
            elif one.text is not None:
                self.echoes.append(one.text)
            else:
                self.echoes.append(await self.serving.frontend.decode(prepared.prompt_token_ids))
        self.choices = [_Choice(num_chars=len(self.echoes[i // self.n]))
                        for i in range(len(self.inputs) * self.n)]

    def on_delta(self, prompt_index: int, delta: TextDelta) -> CompletionChoice:
        """The delta as a choice chunk; the whole choice is accumulated too."""
        index = prompt_index * self.n + delta.index
        choice = self.choices[index]
        text = delta.text
        if self.body.echo and not choice.text:
            text = self.echoes[prompt_index] + text
        logprobs = _logprobs(delta, choice) if self.body.logprobs is not None else None
        choice.text += text
        if logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = CompletionLogprobs()
            for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                getattr(choice.logprobs, name).extend(getattr(logprobs, name))
        choice.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.usages.append(delta.usage)
        return CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=delta.finish_reason)

    def response(self, choices: list[CompletionChoice], with_usage: bool) -> CompletionResponse:
        return CompletionResponse(
            id=self.id, created=self.created, model=self.serving.model_name,
            system_fingerprint=self.serving.system_fingerprint, choices=choices,
            usage=usage_info(self.usages) if with_usage else None)

    async def whole(self, submission: Submission) -> CompletionResponse:
        async with contextlib.aclosing(submission.deltas()) as deltas:
            async for prompt_index, delta in deltas:
                self.on_delta(prompt_index, delta)
        return self.response([CompletionChoice(index=i, text=c.text, logprobs=c.logprobs,
                                               finish_reason=c.finish_reason)
                              for i, c in enumerate(self.choices)], with_usage=True)

    async def events(self, deltas: StartedDeltas) -> AsyncIterator[str]:
        try:
            async with contextlib.aclosing(deltas):
                async for prompt_index, delta in deltas:
                    choice = self.on_delta(prompt_index, delta)
                    if choice.text or choice.logprobs or choice.finish_reason:
                        yield sse.event(self.response([choice], False).model_dump_json())
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield sse.event(self.response([], True).model_dump_json())
        except Exception as exc:
            yield sse.event(error_for(exc).model_dump_json())
        yield sse.DONE


async def create_completion(serving: OpenAIServing, body: CompletionRequest,
                            request: Request) -> Response:
    completion = _Completion(serving, body)
    submission = await Submission.open(serving.frontend, completion.inputs, request)
    try:
        await completion.start(submission)
    except BaseException:
        submission.close()
        raise
    return await respond(submission, request, body.stream, completion.events, completion.whole)
