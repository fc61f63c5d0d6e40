"""The real default model through the OpenAI-compatible HTTP API and the official client."""

import openai
import pytest

from tests.e2e.stack import tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack_config(smollm2_dir):
    return tiny_config(smollm2_dir, kv_cache_memory_gib=0.1, swap_space_gib=0.05)


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=300) as client:
        yield client


def test_chat_answers_paris(client, smollm2_dir):
    chat = client.chat.completions.create(
        model=smollm2_dir.name, temperature=0, max_tokens=20,
        messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in chat.choices[0].message.content
    assert chat.usage.prompt_tokens > 0 and chat.choices[0].finish_reason in ("stop", "length")


def test_streamed_chat_equals_whole(client, smollm2_dir):
    request = {"model": smollm2_dir.name, "temperature": 0, "max_tokens": 12,
               "messages": [{"role": "user", "content": "Name a color."}]}
    whole = client.chat.completions.create(**request).choices[0].message.content
    chunks = client.chat.completions.create(stream=True, **request)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
