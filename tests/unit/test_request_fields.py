"""vLLM's request fields through the gateway, at both doors, against a test double of the
scheduler: each one reaches the scheduler as the sampler applies it (bias, allowed ids, bad words
as token ids, the prompt truncated), or is refused naming it."""

import asyncio
import json

import grpc
import httpx
import pytest
from pagedserve.services.gateway.config import HttpConfig
from pagedserve.services.gateway.openai.request_fields import (
    REFUSED_CHAT_FIELDS,
    REFUSED_COMPLETION_FIELDS,
)
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2

from tests.unit.test_gateway_rich_errors import rich
from tests.unit.test_gateway_servicer import collect, harness
from tests.unit.tiny_tokenizers import byte_level_bpe

TOKENIZER = byte_level_bpe()
PROMPT = "the quick brown fox"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    TOKENIZER.hf_tokenizer.save_pretrained(path)
    return str(path)


def run(model_dir, body):
    async def main():
        async with harness(model_dir) as h:
            return await asyncio.wait_for(body(h), 20)

    return asyncio.run(main())


def grpc_request(**sampling):
    return gateway_pb2.GenerateStreamRequest(text=PROMPT, sampling=common_pb2.SamplingParams(
        max_tokens=4, **sampling))


def test_grpc_token_constraints_reach_the_scheduler_once_as_ids(model_dir):
    async def body(h):
        await collect(h.generation.GenerateStream(grpc_request(
            logit_bias={5: 3.5, 7: -100.0}, allowed_token_ids=[5, 7, 9], bad_words=["fox"],
            truncate_prompt_tokens=2), timeout=10))
        return h.fake.submits[0]

    submit = run(model_dir, body)
    sampling = submit.sampling
    assert dict(sampling.logit_bias) == {5: 3.5, 7: -100.0}
    assert list(sampling.allowed_token_ids) == [5, 7, 9]
    words = [list(w.token_ids) for w in sampling.bad_words_token_ids]
    assert TOKENIZER.encode("fox", add_special_tokens=False) in words
    assert TOKENIZER.encode(" fox", add_special_tokens=False) in words
    assert list(submit.prompt_token_ids) == TOKENIZER.encode(PROMPT)[-2:]


@pytest.mark.parametrize(("sampling", "field"), [
    ({"logit_bias": {99999: 1.0}}, "sampling.logit_bias[99999]"),
    ({"logit_bias": {5: 101.0}}, "sampling.logit_bias"),
    ({"allowed_token_ids": [5, 99999]}, "sampling.allowed_token_ids[1]"),
    ({"bad_words": ["ok", ""]}, "sampling.bad_words[1]"),
    ({"truncate_prompt_tokens": 0}, "sampling.truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": 10**6}, "sampling.truncate_prompt_tokens"),
])
def test_grpc_bad_token_constraints_are_invalid_argument_naming_the_field(model_dir, sampling,
                                                                          field):
    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(grpc_request(**sampling), timeout=5))
        return err.value, h.fake.submits

    err, submits = run(model_dir, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    _, bad_request, _ = rich(err)
    assert bad_request.field_violations[0].field == field, err.details()
    assert submits == []


# ---- the HTTP door: every vLLM field honoured or refused --------------------------------------

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]
BEAM = {"use_beam_search": True, "n": 2, "temperature": 0}


def _s(name, value=None):
    """The field reached the scheduler's SamplingParams with this value (default: as sent)."""
    return lambda submit, sent: getattr(submit.sampling, name) == (
        sent[name] if value is None else value)


# (endpoint, the body's fields, what the scheduler receives)
HONOURED = [
    (COMPLETIONS, {"best_of": 2, "n": 1}, _s("best_of")),
    (COMPLETIONS, {"frequency_penalty": 0.5}, _s("frequency_penalty")),
    (COMPLETIONS, {"presence_penalty": -0.5}, _s("presence_penalty")),
    (COMPLETIONS, {"logit_bias": {"5": 2.5}},
     lambda s, _: dict(s.sampling.logit_bias) == {5: 2.5}),
    (COMPLETIONS, {"logprobs": 2}, _s("logprobs")),
    (COMPLETIONS, {"max_tokens": 3}, _s("max_tokens")),
    (COMPLETIONS, {"n": 2, "temperature": 0}, lambda s, _: (s.sampling.n, s.sampling.temperature)
     == (2, 0.0)),
    (COMPLETIONS, {"seed": 7}, _s("seed")),
    (COMPLETIONS, {"stop": "x"}, lambda s, _: list(s.sampling.stop) == ["x"]),
    (COMPLETIONS, {"temperature": 0.5}, _s("temperature")),
    (COMPLETIONS, {"top_p": 0.5}, _s("top_p")),
    (COMPLETIONS, BEAM, _s("use_beam_search")),
    (COMPLETIONS, {**BEAM, "length_penalty": 0.5}, _s("length_penalty")),
    (COMPLETIONS, {"top_k": 5}, _s("top_k")),
    (COMPLETIONS, {"min_p": 0.25}, _s("min_p")),
    (COMPLETIONS, {"repetition_penalty": 1.25}, _s("repetition_penalty")),
    (COMPLETIONS, {"stop_token_ids": [5]}, lambda s, _: list(s.sampling.stop_token_ids) == [5]),
    (COMPLETIONS, {"include_stop_str_in_output": True}, _s("include_stop_str_in_output")),
    (COMPLETIONS, {"ignore_eos": True}, _s("ignore_eos")),
    (COMPLETIONS, {"min_tokens": 2}, _s("min_tokens")),
    (COMPLETIONS, {"skip_special_tokens": False}, _s("skip_special_tokens")),
    (COMPLETIONS, {"truncate_prompt_tokens": 2}, lambda s, _: len(s.prompt_token_ids) == 2),
    (COMPLETIONS, {"allowed_token_ids": [5, 6]},
     lambda s, _: list(s.sampling.allowed_token_ids) == [5, 6]),
    (COMPLETIONS, {"bad_words": ["fox"]}, lambda s, _: len(s.sampling.bad_words_token_ids) == 2),
    (COMPLETIONS, {"prompt_logprobs": 1}, _s("prompt_logprobs")),
    (COMPLETIONS, {"echo": True, "logprobs": 1}, _s("prompt_logprobs", 1)),
    (COMPLETIONS, {"add_special_tokens": False}, lambda s, _: list(s.prompt_token_ids)
     == TOKENIZER.encode(PROMPT, add_special_tokens=False)),
    (COMPLETIONS, {"priority": 0}, lambda s, _: s.priority == 0),
    (COMPLETIONS, {"request_id": "mine-1"}, lambda s, _: s.request_id == "cmpl-mine-1"),
    (COMPLETIONS, {"spaces_between_special_tokens": True}, lambda s, _: True),  # the default
    (COMPLETIONS, {"user": "someone"}, lambda s, _: True),  # OpenAI's; vLLM ignores it too
    (CHAT, {"max_completion_tokens": 3}, _s("max_tokens", 3)),
    (CHAT, {"logprobs": True, "top_logprobs": 2}, _s("logprobs", 2)),
    (CHAT, {"n": 3, "temperature": 0}, _s("n", 3)),
    (CHAT, {"logit_bias": {"7": -100}}, lambda s, _: dict(s.sampling.logit_bias) == {7: -100.0}),
    (CHAT, {"allowed_token_ids": [9]}, lambda s, _: list(s.sampling.allowed_token_ids) == [9]),
    (CHAT, {"bad_words": ["x y"]}, lambda s, _: len(s.sampling.bad_words_token_ids) >= 1),
    (CHAT, {"prompt_logprobs": 0}, _s("prompt_logprobs")),
    (CHAT, {"truncate_prompt_tokens": 3}, lambda s, _: len(s.prompt_token_ids) == 3),
    (CHAT, {"add_special_tokens": True}, lambda s, _: True),
    (CHAT, {"include_reasoning": True}, lambda s, _: True),  # its default
]


def _asking(allowed: tuple) -> object:
    """A value other than those that ask for nothing."""
    return False if True in allowed else True if False in allowed else "x"


# (endpoint, field, a value that asks for what this server does not serve): every field of the
# refusal tables, and the declared ones refused by value
REFUSED = [(COMPLETIONS, name, _asking(allowed))
           for name, allowed in REFUSED_COMPLETION_FIELDS.items()] + [
    (CHAT, name, _asking(allowed)) for name, allowed in REFUSED_CHAT_FIELDS.items()] + [
    (COMPLETIONS, "suffix", "end"),
    (CHAT, "stream_options", {"include_usage": True, "continuous_usage_stats": True}),
]


def _body(path, fields):
    base = {"prompt": PROMPT} if path == COMPLETIONS else {"messages": USER}
    return {**base, "max_tokens": 4, **fields}


def http_run(model_dir, body, http=None, max_model_len=64):
    async def main():
        async with harness(model_dir, http=http or HttpConfig(http_port=-1),
                           max_model_len=max_model_len) as h:
            url = f"http://127.0.0.1:{h.gateway.http_port}"
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                return await asyncio.wait_for(body(h, client), 60)

    return asyncio.run(main())


def test_every_vllm_field_is_honoured_or_refused_naming_it(model_dir):
    async def body(h, client):
        failures = []
        for path, fields, check in HONOURED:
            response = await client.post(path, json=_body(path, fields))
            if response.status_code != 200 or not check(h.fake.submits[-1], fields):
                failures.append((path, fields, response.status_code, response.text[:200]))
        num_submits = len(h.fake.submits)
        for path, name, value in REFUSED:
            stream = {"stream": True} if name == "stream_options" else {}
            response = await client.post(path, json=_body(path, {name: value, **stream}))
            error = response.json().get("error", {})
            param = error.get("param") or ""
            if response.status_code != 400 or name not in f"{param} {error.get('message')}":
                failures.append((path, name, response.status_code, response.text[:200]))
        return failures, len(h.fake.submits) - num_submits

    failures, num_refused_submits = http_run(model_dir, body)
    assert failures == []
    assert num_refused_submits == 0  # a refused field never reaches the scheduler


def test_an_unknown_field_is_ignored_and_logged_once_per_name(model_dir, caplog):
    async def body(h, client):
        return [(await client.post(COMPLETIONS, json=_body(COMPLETIONS, fields))).status_code
                for fields in ({"frobnicate": 1}, {"frobnicate": 2}, {"quux_field_9": True})]

    caplog.set_level("WARNING", logger="pagedserve.services.gateway.openai.request_fields")
    assert http_run(model_dir, body) == [200, 200, 200]
    logged = [r.getMessage() for r in caplog.records if "not known" in r.getMessage()]
    assert len([m for m in logged if "frobnicate" in m]) == 1
    assert len([m for m in logged if "quux_field_9" in m]) == 1


def test_greedy_n_echo_logprobs_version_and_tokens_as_ids(model_dir):
    async def body(h, client):
        greedy = await client.post(COMPLETIONS, json=_body(COMPLETIONS, {
            "n": 3, "temperature": 0}))
        echo = await client.post(COMPLETIONS, json=_body(COMPLETIONS, {
            "echo": True, "logprobs": 1}))
        version = await client.get("/version")
        as_ids = [(await client.post(path, json=_body(path, {
            **fields, "return_tokens_as_token_ids": True}))).json() for path, fields in (
            (COMPLETIONS, {"logprobs": 1}), (CHAT, {"logprobs": True, "top_logprobs": 1}))]
        return greedy.json(), echo.json(), version, as_ids, h.fake.reply_ids[:4]

    greedy, echo, version, (completion, chat), reply_ids = http_run(model_dir, body)
    labels = [f"token_id:{t}" for t in reply_ids]
    assert completion["choices"][0]["logprobs"]["tokens"] == labels
    assert [t["token"] for t in chat["choices"][0]["logprobs"]["content"]] == labels
    texts = [c["text"] for c in greedy["choices"]]
    assert len(texts) == 3 and len(set(texts)) == 1 and texts[0]
    choice, = echo["choices"]
    prompt_ids = TOKENIZER.encode(PROMPT)
    assert choice["text"].startswith(PROMPT)
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 4
    assert logprobs["token_logprobs"][:3] == [None, -1.0, -1.0]
    assert logprobs["top_logprobs"][0] is None and len(logprobs["top_logprobs"][1]) == 2
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    positions = choice["prompt_logprobs"]
    assert positions[0] is None and len(positions) == len(prompt_ids)
    assert positions[1][str(prompt_ids[1])]["logprob"] == -1.0
    assert version.status_code == 200 and version.json()["version"]


def test_echo_with_max_tokens_zero_answers_the_prompt_alone(model_dir):
    """vLLM's scoring call (lm-eval's loglikelihood): the prompt and its logprobs, no output."""
    async def body(h, client):
        whole = await client.post(COMPLETIONS, json=_body(COMPLETIONS, {
            "echo": True, "logprobs": 1, "max_tokens": 0}))
        streamed = await client.post(COMPLETIONS, json=_body(COMPLETIONS, {
            "echo": True, "max_tokens": 0, "stream": True}))
        return whole.json(), streamed.text

    whole, streamed = http_run(model_dir, body)
    choice, = whole["choices"]
    assert choice["text"] == PROMPT
    assert len(choice["logprobs"]["tokens"]) == len(TOKENIZER.encode(PROMPT))
    assert choice["logprobs"]["token_logprobs"][1:3] == [-1.0, -1.0]
    texts = [json.loads(line[len("data: "):])["choices"][0]["text"]
             for line in streamed.splitlines()
             if line.startswith("data: {") and json.loads(line[len("data: "):])["choices"]]
    assert "".join(texts) == PROMPT


TEMPLATE = ("{% for m in messages %}[{{ m.role }}{% if m.tool_calls %} calls "
            "{{ m.tool_calls[0].function.name }}({{ m.tool_calls[0].function.arguments.city }})"
            "{% endif %}]{{ m.content }}{% endfor %}"
            "{% if enable_thinking %}<think>{% endif %}{% if add_generation_prompt %}>>{% endif %}")


def test_chat_template_flag_kwargs_and_tool_and_developer_roles_reach_the_template(model_dir):
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "c1", "type": "function",
            "function": {"name": "weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]

    async def body(h, client):
        rendered = []
        for extra in ({}, {"chat_template_kwargs": {"enable_thinking": True}},
                      {"add_generation_prompt": False, "continue_final_message": True}):
            response = await client.post(CHAT, json={"messages": messages, "max_tokens": 2,
                                                     **extra})
            assert response.status_code == 200, response.text
            rendered.append(TOKENIZER.decode(h.fake.submits[-1].prompt_token_ids,
                                             skip_special_tokens=False))
        started = [{"role": "user", "content": "go"}, {"role": "assistant", "content": "Once"}]
        echoed = await client.post(CHAT, json={
            "messages": started, "max_tokens": 2, "echo": True, "add_generation_prompt": False,
            "continue_final_message": True})
        assert echoed.json()["choices"][0]["message"]["content"].startswith("Once")
        bad = await client.post(CHAT, json={"messages": USER, "chat_template_kwargs": {
            "tokenize": True}})
        tokenized = await client.post("/tokenize", json={
            "messages": messages, "chat_template_kwargs": {"enable_thinking": True}})
        rendered.append(TOKENIZER.decode(tokenized.json()["tokens"], skip_special_tokens=False))
        return rendered, bad

    rendered, bad = http_run(model_dir, body, HttpConfig(http_port=-1, chat_template=TEMPLATE),
                             max_model_len=512)
    conversation = "[developer]be brief[user]weather?[assistant calls weather(Paris)][tool]sunny"
    assert rendered == [conversation + ">>", conversation + "<think>>>", conversation,
                        conversation + "<think>>>"]
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "chat_template_kwargs.tokenize"
