"""POST /v1/completions: one or many prompts, n choices each (choice index = prompt index * n +
output index), streamed as `text_completion` chunks or returned whole."""

from __future__ import annotations

import contextlib
import dataclasses
import uuid
from collections.abc import AsyncIterator, Callable

from pagedserve.services.common.outputs import TokenLogprob, Usage
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
from pagedserve.services.gateway.openai.http_span import record_request
from pagedserve.services.gateway.openai.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobs,
    now_s,
)
from pagedserve.services.gateway.openai.serving import (
    OpenAIServing,
    logprob_value,
    prompt_logprobs_body,
    token_label,
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
    has_started: bool = False


def _echo_logprobs(first_token: TokenLogprob, positions: list[list[TokenLogprob]],
                   num_top: int, label: Callable[[TokenLogprob], str]) -> CompletionLogprobs:
    """The echoed prompt's tokens as `logprobs` entries (the first has none), before the
    output's: what vLLM answers to echo with logprobs."""
    out = CompletionLogprobs(text_offset=[0], token_logprobs=[None], tokens=[label(first_token)],
                             top_logprobs=[None])
    num_chars = len(first_token.text)
    for candidates in positions:
        if not candidates:  # none reported for this position
            out.tokens.append("")
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(num_chars)
            continue
        target, *top = candidates
        out.tokens.append(label(target))
        out.token_logprobs.append(logprob_value(target.logprob))
        best = {label(c): logprob_value(c.logprob) for c in top[:num_top]}
        best.setdefault(label(target), logprob_value(target.logprob))
        out.top_logprobs.append(best)
        out.text_offset.append(num_chars)
        num_chars += len(target.text)
    return out


def _logprobs(delta: TextDelta, choice: _Choice,
              label: Callable[[TokenLogprob], str]) -> CompletionLogprobs:
    """The sampled token's logprob, and the top candidates with the sampled one among them."""
    out = CompletionLogprobs()
    for i, sampled in enumerate(delta.logprobs):
        out.tokens.append(label(sampled))
        out.token_logprobs.append(logprob_value(sampled.logprob))
        top = {label(c): logprob_value(c.logprob)
               for c in (delta.top_logprobs[i] if i < len(delta.top_logprobs) else ())}
        top.setdefault(label(sampled), logprob_value(sampled.logprob))
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
        self.id = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        self.created = now_s()
        frontend = serving.frontend
        # echo with logprobs reports the prompt's tokens too (vLLM)
        echoed_logprobs = body.logprobs if body.echo and body.prompt_logprobs is None else None
        # echo with max_tokens 0 answers the prompt alone (vLLM): one token is drawn, not shown
        self.echo_only = bool(body.echo) and body.max_tokens == 0
        sampling = sampling_params(body, 1 if self.echo_only else body.max_tokens,
                                   body.logprobs, echoed_logprobs, limits=frontend.limits)
        self.wants_prompt_logprobs = sampling.prompt_logprobs is not None
        record_request(self.id, sampling)
        check_prompt_size(body.prompt, sampling, frontend.limits, frontend.info)
        prompts = completion_prompts(body.prompt)
        self.inputs = [dataclasses.replace(
            p, sampling=sampling, priority=body.priority,
            add_special_tokens=body.add_special_tokens,
            request_id=self.id if len(prompts) == 1 else f"{self.id}-{i}")
            for i, p in enumerate(prompts)]
        self.n = sampling.n
        self.echoes: list[str] = []
        self.first_tokens: list[TokenLogprob] = []  # of each prompt: its echo has no logprob
        self.label = token_label(body.return_tokens_as_token_ids)
        self.prompt_logprobs: list[list[list[TokenLogprob]] | None] = [None] * len(prompts)
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
            first_id = prepared.prompt_token_ids[0]
            self.first_tokens.append(TokenLogprob(first_id, 0.0, self.serving.frontend.tokenizer
                                                  .decode([first_id], skip_special_tokens=False)))
        self.choices = [_Choice(num_chars=len(self.echoes[i // self.n]))
                        for i in range(len(self.inputs) * self.n)]

    def on_delta(self, prompt_index: int, delta: TextDelta) -> CompletionChoice:
        """The delta as a choice chunk; the whole choice is accumulated too."""
        index = prompt_index * self.n + delta.index
        choice = self.choices[index]
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = delta.prompt_logprobs
        text = "" if self.echo_only else delta.text
        logprobs = None
        if self.body.logprobs is not None:
            logprobs = (CompletionLogprobs() if self.echo_only
                        else _logprobs(delta, choice, self.label))
        if self.body.echo and not choice.has_started:
            text = self.echoes[prompt_index] + text
            positions = self.prompt_logprobs[prompt_index]
            if logprobs is not None and positions is not None:
                echoed = _echo_logprobs(self.first_tokens[prompt_index], positions,
                                        self.body.logprobs or 0, self.label)
                for name in ("text_offset", "token_logprobs", "tokens", "top_logprobs"):
                    getattr(echoed, name).extend(getattr(logprobs, name))
                logprobs = echoed
        choice.has_started = True
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

    def stream_event(self, template: sse.ChunkTemplate, prompt_index: int,
                     delta: TextDelta) -> str | None:
        """The delta's chunk event (None when it carries nothing to send); without logprobs
        the choice is written straight to JSON, and its text is not kept (no whole response)."""
        if self.body.logprobs is not None:
            choice = self.on_delta(prompt_index, delta)
            if not (choice.text or choice.logprobs or choice.finish_reason):
                return None
            return sse.event(self.response([choice], False).model_dump_json())
        index = prompt_index * self.n + delta.index
        choice = self.choices[index]
        text = "" if self.echo_only else delta.text
        if self.body.echo and not choice.has_started:
            text = self.echoes[prompt_index] + text
        choice.has_started = True
        if delta.usage is not None:
            self.usages.append(delta.usage)
        if not (text or delta.finish_reason):
            return None
        return template.event(f'{{"index":{index},"text":{sse.json_string(text)},'
                              f'"logprobs":null,"finish_reason":'
                              f'{sse.json_string(delta.finish_reason)}}}')

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
                                               finish_reason=c.finish_reason,
                                               prompt_logprobs=self._prompt_logprobs(i // self.n))
                              for i, c in enumerate(self.choices)
                              if c.finish_reason is not None], with_usage=True)

    def _prompt_logprobs(self, prompt_index: int) -> PromptLogprobs | None:
        positions = self.prompt_logprobs[prompt_index]
        if not self.wants_prompt_logprobs or positions is None:
            return None
        return prompt_logprobs_body(positions)

    async def events(self, deltas: StartedDeltas) -> AsyncIterator[str]:
        template = sse.ChunkTemplate(self.response([], False).model_dump_json())
        try:
            async with contextlib.aclosing(deltas):
                async for prompt_index, delta in deltas:
                    event = self.stream_event(template, prompt_index, delta)
                    if event is not None:
                        yield event
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
