"""POST /v1/chat/completions: the messages (and tools) through the model's chat template, n
choices, streamed as `chat.completion.chunk`s (the role first, then content, then the finish
reason) or returned whole. A choice that may hold tool calls streams them as the OpenAI API does:
a call's first delta names it, the next ones carry its arguments as they are generated."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Callable

from pagedserve.services.common.outputs import TokenLogprob, Usage
from pagedserve.services.gateway.openai import sse
from pagedserve.services.gateway.openai.convert import (
    chat_max_tokens,
    chat_messages,
    chat_options,
    chat_requested_max_tokens,
    chat_top_logprobs,
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
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    FunctionCallDelta,
    PromptLogprobs,
    ToolCall,
    ToolCallDelta,
    now_s,
)
from pagedserve.services.gateway.openai.serving import (
    OpenAIServing,
    logprob_value,
    prompt_logprobs_body,
    token_label,
    top_logprob,
    usage_info,
)
from pagedserve.services.gateway.openai.tool_parser import CallStart, Piece
from pagedserve.services.gateway.openai.tools import (
    ToolUse,
    parse_tool_calls,
    tool_call_parser,
    tool_constraint,
    tool_use,
)
from pagedserve.services.gateway.validation import GenerateInput
from pagedserve.services.text.text_stream import TextDelta
from starlette.requests import Request
from starlette.responses import Response


def _logprobs(delta: TextDelta, label: Callable[[TokenLogprob], str]) -> ChatLogprobs:
    content = []
    for i, sampled in enumerate(delta.logprobs):
        top = delta.top_logprobs[i] if i < len(delta.top_logprobs) else []
        token = label(sampled)
        content.append(ChatTokenLogprob(
            token=token, logprob=logprob_value(sampled.logprob), bytes=list(token.encode()),
            top_logprobs=[top_logprob(c, label) for c in top]))
    return ChatLogprobs(content=content)


def _tool_deltas(pieces: list[Piece]) -> list[tuple[str, list[ToolCallDelta]]]:
    """The content and tool-call deltas of a parser's pieces, one chunk's each: a call's start
    has a chunk of its own (its arguments ""), as OpenAI sends it."""
    chunks: list[tuple[str, list[ToolCallDelta]]] = [("", [])]
    for piece in pieces:
        content, calls = chunks[-1]
        if isinstance(piece, str):
            chunks[-1] = (content + piece, calls)
        elif isinstance(piece, CallStart):
            start = ToolCallDelta(index=piece.index, id=piece.id, type="function",
                                  function=FunctionCallDelta(name=piece.name, arguments=""))
            chunks[-1:] = [c for c in (chunks[-1],) if c[0] or c[1]] + [("", [start]), ("", [])]
        elif calls and calls[-1].index == piece.index:
            calls[-1].function.arguments += piece.text
        elif piece.text:
            calls.append(ToolCallDelta(index=piece.index,
                                       function=FunctionCallDelta(arguments=piece.text)))
    return chunks


def _messages_input(serving: OpenAIServing, body: ChatCompletionRequest,
                    use: ToolUse | None) -> GenerateInput:
    """The request as its messages, with the max tokens it asks for (at least 1): what its cost
    is checked and admitted by before the template renders them."""
    requested = chat_requested_max_tokens(body)
    sampling = sampling_params(body, 1 if requested is None else requested,
                               chat_top_logprobs(body), limits=serving.frontend.limits,
                               constraint=tool_constraint(use, body.parallel_tool_calls))
    return GenerateInput(messages=chat_messages(body.messages), sampling=sampling,
                         priority=body.priority, chat=chat_options(body),
                         add_special_tokens=body.add_special_tokens,
                         tools=tuple(use.tools) if use else None)


class _Chat:
    def __init__(self, serving: OpenAIServing, body: ChatCompletionRequest,
                 token_ids: list[int], use: ToolUse | None) -> None:
        """`token_ids`: the messages through the chat template."""
        self.serving = serving
        self.body = body
        self.tool_use = use if use is not None and use.parses_output else None
        self.tool_parsers = []
        self.id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        self.created = now_s()
        logprobs = chat_top_logprobs(body)
        max_tokens = chat_max_tokens(body, len(token_ids), serving.frontend.info)
        sampling = sampling_params(body, max_tokens, logprobs, limits=serving.frontend.limits,
                                   constraint=tool_constraint(use, body.parallel_tool_calls))
        record_request(self.id, sampling)
        self.input = GenerateInput(request_id=self.id, token_ids=tuple(token_ids),
                                   sampling=sampling, priority=body.priority, operation="chat")
        self.texts = [""] * sampling.n
        if self.tool_use is not None:
            self.tool_parsers = [tool_call_parser(self.tool_use, serving.tool_call_parser)
                                 for _ in range(sampling.n)]
        self.logprobs = [ChatLogprobs() if logprobs is not None else None
                         for _ in range(sampling.n)]
        self.finish_reasons: list[str | None] = [None] * sampling.n
        self.usages: list[Usage] = []
        self.prompt_logprobs: PromptLogprobs | None = None
        self.has_started = [False] * sampling.n
        last = body.messages[-1]
        # echo (vLLM): an answer continues the last message when that is the assistant's own
        self.echo = (chat_messages([last])[0].content
                     if body.echo and last.role == "assistant" else "")

    def on_delta(self, delta: TextDelta) -> ChatChunkChoice:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = prompt_logprobs_body(delta.prompt_logprobs)
        logprobs = (_logprobs(delta, token_label(self.body.return_tokens_as_token_ids))
                    if self.body.logprobs else None)
        text = delta.text
        if not self.has_started[delta.index]:
            self.has_started[delta.index] = True
            text = self.echo + text
        self.texts[delta.index] += text
        whole = self.logprobs[delta.index]
        if whole is not None and logprobs is not None:
            whole.content.extend(logprobs.content)
        self.finish_reasons[delta.index] = delta.finish_reason
        if delta.usage is not None:
            self.usages.append(delta.usage)
        return ChatChunkChoice(index=delta.index, delta=ChatDelta(content=text or None),
                               logprobs=logprobs, finish_reason=delta.finish_reason)

    def stream_event(self, template: sse.ChunkTemplate, delta: TextDelta) -> str | None:
        """The delta's chunk event (None when it carries nothing to send); without logprobs
        the choice is written straight to JSON, and its text is not kept (no whole message).
        A choice that may hold tool calls goes through its parser."""
        if self.tool_use is not None:
            return self._tool_event(self.on_delta(delta))
        if self.body.logprobs:
            choice = self.on_delta(delta)
            if not (choice.delta.content or choice.logprobs or choice.finish_reason):
                return None
            return self.chunk([choice])
        text = delta.text
        if not self.has_started[delta.index]:
            self.has_started[delta.index] = True
            text = self.echo + text
        if delta.usage is not None:
            self.usages.append(delta.usage)
        if not (text or delta.finish_reason):
            return None
        content = f'"content":{sse.json_string(text)}' if text else ""
        return template.event(f'{{"index":{delta.index},"delta":{{{content}}},"logprobs":null,'
                              f'"finish_reason":{sse.json_string(delta.finish_reason)}}}')

    def chunk(self, choices: list[ChatChunkChoice], with_usage: bool = False) -> str:
        return sse.event(self.chunk_json(choices, with_usage))

    def chunk_json(self, choices: list[ChatChunkChoice], with_usage: bool = False) -> str:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.serving.model_name,
            system_fingerprint=self.serving.system_fingerprint, choices=choices,
            usage=usage_info(self.usages) if with_usage else None).model_dump_json()

    def _tool_event(self, choice: ChatChunkChoice) -> str | None:
        parser = self.tool_parsers[choice.index]
        pieces = parser.feed(choice.delta.content or "")
        if choice.finish_reason is not None:
            pieces += parser.finish()
        chunks = _tool_deltas(pieces)
        finish_reason = self._finish_reason(choice.finish_reason, parser.num_calls)
        if not (chunks[-1][0] or chunks[-1][1] or choice.logprobs or finish_reason):
            chunks.pop()
        last = len(chunks) - 1
        return "".join(self.chunk([ChatChunkChoice(
            index=choice.index, delta=ChatDelta(content=content or None, tool_calls=calls or None),
            logprobs=choice.logprobs if i == last else None,
            finish_reason=finish_reason if i == last else None)])
            for i, (content, calls) in enumerate(chunks)) or None

    def _finish_reason(self, finish_reason: str | None, num_calls: int) -> str | None:
        # OpenAI: a named call stops; one cut off by max_tokens keeps its length
        if num_calls and finish_reason == "stop" and self.tool_use.mode != "named":
            return "tool_calls"
        return finish_reason

    def message(self, index: int) -> tuple[str | None, list[ToolCall], str | None]:
        """A finished choice's content, tool calls and finish reason."""
        text, finish_reason = self.texts[index], self.finish_reasons[index]
        if self.tool_use is None:
            return text, [], finish_reason
        content, calls = parse_tool_calls(text, self.tool_use, self.serving.tool_call_parser)
        return content, calls, self._finish_reason(finish_reason, len(calls))

    async def whole(self, submission: Submission) -> ChatCompletionResponse:
        async with contextlib.aclosing(submission.deltas()) as deltas:
            async for _, delta in deltas:
                self.on_delta(delta)
        choices = []
        for i in range(len(self.texts)):
            if self.finish_reasons[i] is None:
                continue  # none: beam search under a constraint with fewer completions than n
            content, calls, finish_reason = self.message(i)
            choices.append(ChatChoice(
                index=i, message=ChatMessageOut(content=content, tool_calls=calls or None),
                logprobs=self.logprobs[i], finish_reason=finish_reason))
        return ChatCompletionResponse(
            id=self.id, created=self.created, model=self.serving.model_name,
            system_fingerprint=self.serving.system_fingerprint, choices=choices,
            usage=usage_info(self.usages), prompt_logprobs=self.prompt_logprobs)

    async def events(self, deltas: StartedDeltas) -> AsyncIterator[str]:
        try:
            yield self.chunk([ChatChunkChoice(index=i, delta=ChatDelta(role="assistant",
                                                                       content=""))
                              for i in range(len(self.texts))])
            template = sse.ChunkTemplate(self.chunk_json([]))
            async with contextlib.aclosing(deltas):
                async for _, delta in deltas:
                    event = self.stream_event(template, delta)
                    if event is not None:
                        yield event
            options = self.body.stream_options
            if options is not None and options.include_usage:
                yield self.chunk([], with_usage=True)
        except Exception as exc:
            yield sse.event(error_for(exc).model_dump_json())
        yield sse.DONE


async def create_chat_completion(serving: OpenAIServing, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    serving.check_model(body.model)
    use = tool_use(body)
    messages = _messages_input(serving, body, use)
    submission = Submission.admit(serving.frontend, [messages], request)
    try:
        chat = _Chat(serving, body, await serving.frontend.prompt_token_ids(messages), use)
    except BaseException:
        submission.close()
        raise
    await submission.prepare([chat.input])
    return await respond(submission, request, body.stream, chat.events, chat.whole)
