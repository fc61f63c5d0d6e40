"""The official `openai` client against the gateway's OpenAI-compatible HTTP API, on the tiny
stack (real worker, scheduler and gateway): what an OpenAI user sees, and the same answers as
the gRPC API."""

import grpc
import httpx
import openai
import pytest
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle

MODEL = "tiny-llama"  # the model folder's name
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]
GREEDY = {"temperature": 0.0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def client(stack):
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="unused", max_retries=0,
                       timeout=60) as client:
        yield client


def grpc_text(stack, **prompt) -> str:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        response = stub.Generate(gateway_pb2.GenerateRequest(
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            **prompt), timeout=60)
    return response.outputs[0].text


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_greedy_completion_equals_the_grpc_api(stack, client):
    completion = client.completions.create(model=MODEL, prompt="the quick brown fox", **GREEDY)
    choice = completion.choices[0]
    assert choice.text == grpc_text(stack, text="the quick brown fox")
    assert choice.finish_reason == "length"
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    assert completion.system_fingerprint and completion.created > 0
    tokens = httpx.post(f"{stack.http_url}/tokenize", json={"prompt": "the quick brown fox"})
    assert completion.usage.prompt_tokens == tokens.json()["count"]
    assert completion.usage.completion_tokens == 12
    assert completion.usage.total_tokens == completion.usage.prompt_tokens + 12
    assert completion.usage.prompt_tokens_details.cached_tokens >= 0


def test_greedy_chat_equals_the_grpc_api(stack, client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    messages = common_pb2.ChatMessages(messages=[common_pb2.ChatMessage(**m) for m in MESSAGES])
    assert chat.choices[0].message.content == grpc_text(stack, messages=messages)
    assert chat.choices[0].message.role == "assistant"
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.usage.completion_tokens == 12


def test_streaming_equals_whole(client):
    whole = client.completions.create(model=MODEL, prompt=[5, 80, 200, 31], **GREEDY)
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 80, 200, 31], stream=True,
                                            stream_options={"include_usage": True}, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12

    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, **GREEDY)
    stream = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                                 **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" and c.id == stream[0].id for c in stream)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == \
        chat.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


def test_n_choices_and_several_prompts(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, max_tokens=6,
                                          temperature=1.0, seed=3)
    assert [c.index for c in chat.choices] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in chat.choices)
    completion = client.completions.create(model=MODEL, prompt=["one", "two"], n=2, max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1, 2, 3]
    assert completion.usage.completion_tokens == 16


def test_seed_reproduces_the_sample(client):
    def sample():
        return client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                              temperature=1.0, seed=1234)
    assert sample().choices[0].message.content == sample().choices[0].message.content


def test_stop_string_ends_the_output(client):
    full = client.completions.create(model=MODEL, prompt="abc", **GREEDY).choices[0].text
    stop = full[4:6]
    assert stop.strip(), f"no usable stop string in {full!r}"
    stopped = client.completions.create(model=MODEL, prompt="abc", stop=[stop], **GREEDY)
    assert stopped.choices[0].text == full[:full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"


def test_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, logprobs=True,
                                          top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 12
    assert all(len(t.top_logprobs) == 3 and t.logprob <= 0 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.logprob >= max(c.logprob for c in t.top_logprobs) - 1e-4 for t in content)

    completion = client.completions.create(model=MODEL, prompt="abc", logprobs=2, **GREEDY)
    logprobs = completion.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 12
    # keyed by token text: candidates that decode alike (byte pieces) share one key
    assert all(token in top and 1 <= len(top) <= 3
               for token, top in zip(logprobs.tokens, logprobs.top_logprobs, strict=True))
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_echo_prepends_the_prompt(client):
    completion = client.completions.create(model=MODEL, prompt="echo me", echo=True, **GREEDY)
    plain = client.completions.create(model=MODEL, prompt="echo me", **GREEDY)
    assert completion.choices[0].text == "echo me" + plain.choices[0].text


def test_vllm_sampling_fields_shape_the_output(stack, client):
    plain = client.completions.create(model=MODEL, prompt="abc", **GREEDY)
    target = httpx.post(f"{stack.http_url}/tokenize", json={
        "prompt": " zebra", "add_special_tokens": False}).json()["tokens"]
    biased = client.completions.create(model=MODEL, prompt="abc", logit_bias={
        str(target[0]): 100}, **GREEDY)
    assert biased.choices[0].text != plain.choices[0].text
    allowed = client.completions.create(model=MODEL, prompt="abc", **{
        **GREEDY, "extra_body": {"ignore_eos": True, "allowed_token_ids": target[:1]}})
    assert allowed.choices[0].text == biased.choices[0].text  # the one token left, 12 times
    copies = client.chat.completions.create(model=MODEL, messages=MESSAGES, n=3, **GREEDY)
    assert len({c.message.content for c in copies.choices}) == 1 and len(copies.choices) == 3
    echo = client.completions.create(model=MODEL, prompt="echo me", echo=True, logprobs=1,
                                     **GREEDY)
    logprobs = echo.choices[0].logprobs
    assert logprobs.token_logprobs[0] is None and len(logprobs.tokens) > 12
    assert all(lp is not None and lp <= 0 for lp in logprobs.token_logprobs[1:])


def test_version(stack):
    assert httpx.get(f"{stack.http_url}/version").json()["version"]


def test_bad_request_and_unknown_model_raise_the_openai_errors(stack, client):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="x", temperature=-1)
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert exc.value.code == "MODEL_NOT_FOUND"
    assert_idle(stack)
