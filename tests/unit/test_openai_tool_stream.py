"""Tool calls streamed through the official openai client as the OpenAI API streams them, the
scheduler a fake that replies a scripted text a token at a time: each call's first delta carries
its index, id, type and name with empty arguments, the arguments follow in fragments that join
into the returned call's arguments exactly, content before the calls streams as content, and
the finish reason is the returned one -- for auto (hermes, llama3_json), required and named."""

import asyncio
from pathlib import Path

import openai
import pytest
from pagedserve.services.gateway.config import HttpConfig

from tests.unit.test_gateway_servicer import harness
from tests.unit.tiny_tokenizers import byte_level_bpe

TOKENIZER = byte_level_bpe()
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
    for name in ("weather", "time")]
USER = [{"role": "user", "content": "the weather?"}]
REPLIES = {
    "hermes": ('I will look.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n'
               '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {"city": "Rome"}}\n'
               '</tool_call>', "auto"),
    "llama3_json": ('{"name": "weather", "parameters": {"city": "Lima"}}; '
                    '{"name": "time", "parameters": {"city": "Kyiv"}}', "auto"),
    "required": ('[{"name": "time", "parameters": {"city": "Bern"}}, '
                 '{"name": "weather", "parameters": {"city": "Oslo"}}]', "required"),
    "named": ('{"city": "Quito"}', {"type": "function", "function": {"name": "time"}}),
}


def _run(model_dir, parser: str, reply: str, body):
    async def main():
        async with harness(model_dir, max_model_len=512,
                           http=HttpConfig(http_port=-1, tool_call_parser=parser)) as h:
            h.fake.reply_ids = TOKENIZER.encode(reply, add_special_tokens=False)
            async with openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{h.gateway.http_port}/v1",
                                          api_key="unused", max_retries=0) as client:
                return await asyncio.wait_for(body(client), 60)

    return asyncio.run(main())


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    TOKENIZER.hf_tokenizer.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("kind", sorted(REPLIES))
def test_streamed_tool_calls_add_up_to_the_returned_ones(model_dir, kind):
    reply, tool_choice = REPLIES[kind]
    request = {"model": Path(model_dir).name, "messages": USER, "tools": TOOLS,
               "tool_choice": tool_choice, "max_tokens": 200}

    async def body(client):
        whole = await client.chat.completions.create(**request)
        stream = await client.chat.completions.create(stream=True, **request)
        return whole.choices[0], [chunk async for chunk in stream]

    parser = kind if tool_choice == "auto" else ""
    whole, chunks = _run(model_dir, parser, reply, body)
    assert whole.message.tool_calls, whole
    calls: list[dict] = []
    content = ""
    for chunk in chunks:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                if delta.index == len(calls):  # a call's first delta
                    assert delta.id and delta.type == "function" and delta.function.name
                    assert delta.function.arguments == ""
                    calls.append({"id": delta.id, "name": delta.function.name, "fragments": []})
                else:
                    assert delta.id is None and delta.function.name is None
                    calls[delta.index]["fragments"].append(delta.function.arguments)
    assert content == (whole.message.content or "")
    assert [(c["name"], "".join(c["fragments"])) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert all(len(c["fragments"]) > 3 for c in calls)  # as they are generated, not whole
    assert chunks[-1].choices[0].finish_reason == whole.finish_reason
    assert whole.finish_reason == ("stop" if kind == "named" else "tool_calls")
    if kind == "hermes":
        assert content == "I will look."
