"""The OpenAI door's per-token serialization: one streamed chunk event, built as a pydantic model
and dumped (what the door did before) against its stream's ChunkTemplate with the choice's JSON
spliced in (what it does now), for /v1/completions and /v1/chat/completions chunks, same run.

The best of several repeats is kept, so a shared, loaded host's noise does not enter the
figure. It times the serialization alone: a token's way through the door also costs the
detokenizer, the delta buffer, the ASGI send and h11's framing (bench.serving measures the whole).

    python -m bench.sse_serialization
"""

from __future__ import annotations

import argparse
import timeit
from collections.abc import Callable

from pagedserve.services.gateway.openai import sse
from pagedserve.services.gateway.openai.protocol import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    CompletionChoice,
    CompletionResponse,
)

from bench.common import finish

TEXTS = [" Paris", " is", " the", " capital", " of", " France", ".", " Ünïcödé", ' "q"', "\n"]


def _completion_pydantic(text: str) -> str:
    return sse.event(CompletionResponse(
        id="cmpl-0123456789abcdef", created=1764000000, model="SmolLM2-1.7B",
        system_fingerprint="fp_0123456789", choices=[CompletionChoice(index=0, text=text)],
    ).model_dump_json())


_COMPLETION = sse.ChunkTemplate(CompletionResponse(
    id="cmpl-0123456789abcdef", created=1764000000, model="SmolLM2-1.7B",
    system_fingerprint="fp_0123456789", choices=[]).model_dump_json())


def _completion_template(text: str) -> str:
    return _COMPLETION.event(f'{{"index":0,"text":{sse.json_string(text)},"logprobs":null,'
                             f'"finish_reason":null}}')


def _chat_pydantic(text: str) -> str:
    return sse.event(ChatCompletionChunk(
        id="chatcmpl-0123456789abcdef", created=1764000000, model="SmolLM2-1.7B",
        system_fingerprint="fp_0123456789",
        choices=[ChatChunkChoice(index=0, delta=ChatDelta(content=text))]).model_dump_json())


_CHAT = sse.ChunkTemplate(ChatCompletionChunk(
    id="chatcmpl-0123456789abcdef", created=1764000000, model="SmolLM2-1.7B",
    system_fingerprint="fp_0123456789", choices=[]).model_dump_json())


def _chat_template(text: str) -> str:
    return _CHAT.event(f'{{"index":0,"delta":{{"content":{sse.json_string(text)}}},'
                       f'"logprobs":null,"finish_reason":null}}')


def per_event_us(render: Callable[[str], str], num_events: int, repeats: int) -> float:
    def run() -> None:
        for i in range(num_events):
            render(TEXTS[i % len(TEXTS)])

    return min(timeit.repeat(run, number=1, repeat=repeats)) / num_events * 1e6


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-events", type=int, default=20_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    results = []
    for name, before, after in (("completion", _completion_pydantic, _completion_template),
                                ("chat", _chat_pydantic, _chat_template)):
        if before(' say "hi"\n') != after(' say "hi"\n'):
            raise RuntimeError(f"the {name} template writes another chunk than pydantic")
        pydantic_us = per_event_us(before, args.num_events, args.repeats)
        template_us = per_event_us(after, args.num_events, args.repeats)
        results.append({"chunk": name, "pydantic_us": pydantic_us, "template_us": template_us,
                        "speedup": pydantic_us / template_us})
    line = "SSE serialization per event: " + "; ".join(
        f"{r['chunk']} pydantic {r['pydantic_us']:.2f} us, template {r['template_us']:.2f} us "
        f"({r['speedup']:.0f}x)" for r in results)
    return finish("sse_serialization", args, line, results)


if __name__ == "__main__":
    main()
