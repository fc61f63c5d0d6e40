"""A streamed chunk spliced from its template is the JSON pydantic writes for the same chunk,
whatever the text holds (quotes, escapes, control characters, non-ASCII)."""

import json

import pytest
from pagedserve.services.gateway.openai import sse
from pagedserve.services.gateway.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)

TEXTS = [" Paris", 'say "hi"\\n', "line\nbreak\ttab\x00\x1f\x7f", "Ünïcödé 日本 🙂", "</script>"]


def _event_json(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: "):-2])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish_reason", [None, "stop"])
def test_a_completion_chunk_is_what_pydantic_writes(text, finish_reason):
    def chunk(choices):
        return CompletionResponse(id="cmpl-1", created=7, model='m"odel', system_fingerprint="fp",
                                  choices=choices)

    template = sse.ChunkTemplate(chunk([]).model_dump_json())
    event = template.event(f'{{"index":3,"text":{sse.json_string(text)},"logprobs":null,'
                           f'"finish_reason":{sse.json_string(finish_reason)}}}')
    expected = chunk([CompletionChoice(index=3, text=text, finish_reason=finish_reason)])
    assert event == sse.event(expected.model_dump_json())


@pytest.mark.parametrize("text", TEXTS)
def test_a_chat_chunk_is_what_pydantic_writes(text):
    def chunk(choices):
        return ChatCompletionChunk(id="chatcmpl-1", created=7, model="m", choices=choices)

    template = sse.ChunkTemplate(chunk([]).model_dump_json())
    event = template.event(f'{{"index":0,"delta":{{"content":{sse.json_string(text)}}},'
                           f'"logprobs":null,"finish_reason":null}}')
    expected = chunk([ChatChunkChoice(index=0, delta=ChatDelta(content=text))])
    assert _event_json(event) == json.loads(expected.model_dump_json())
