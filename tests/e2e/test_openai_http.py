"""The OpenAI-compatible HTTP API over raw HTTP (httpx) on the tiny stack: every bad field is a
400 naming it, the error statuses, the API key on both doors, a client that leaves mid-request
frees its blocks, and many streaming clients at once."""

import asyncio
import json

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.scheduler_svc.servicer import stop_scheduler
from pagedserve.services.gateway.config import HttpConfig, RoutingConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle, start_stack, tiny_config

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
USER = [{"role": "user", "content": "hi"}]
KEY = "sesame-open"
LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0.0}


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.http_url, timeout=60) as client:
        yield client


BAD_FIELDS = [
    (COMPLETIONS, {"prompt": ""}, "prompt"),
    (COMPLETIONS, {"prompt": []}, "prompt"),
    (COMPLETIONS, {"prompt": [1, "two"]}, "prompt"),
    (COMPLETIONS, {"prompt": [7, 99999]}, "prompt"),
    (COMPLETIONS, {"prompt": {"text": "x"}}, "prompt"),
    (COMPLETIONS, {}, "prompt"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    (COMPLETIONS, {"prompt": "x", "temperature": -1}, "temperature"),
    (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
    (COMPLETIONS, {"prompt": "x", "top_k": -5}, "top_k"),
    (COMPLETIONS, {"prompt": "x", "min_p": 2}, "min_p"),
    (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
    (COMPLETIONS, {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
    (COMPLETIONS, {"prompt": "x", "n": 2, "best_of": 1}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "stop": [""]}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop": 3}, "stop"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [-1]}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "x", "stop_token_ids": [100000]}, "stop_token_ids"),
    (COMPLETIONS, {"prompt": "x", "max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
    (COMPLETIONS, {"prompt": "x", "seed": "abc"}, "seed"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"five": 10}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    (COMPLETIONS, {"prompt": "x", "allowed_token_ids": []}, "allowed_token_ids"),
    (COMPLETIONS, {"prompt": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    (COMPLETIONS, {"prompt": "x", "bad_words": [""]}, "bad_words"),
    (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 2, "stream": True}, "prompt_logprobs"),
    (COMPLETIONS, {"prompt": "x", "suffix": "end"}, "suffix"),
    (COMPLETIONS, {"prompt": "x", "use_beam_search": True, "temperature": 0}, "best_of"),
    (COMPLETIONS, {"prompt": "x", "priority": "high"}, "priority"),
    (COMPLETIONS, {"prompt": "x", "echo": "loud"}, "echo"),
    (CHAT, {"messages": []}, "messages"),
    (CHAT, {}, "messages"),
    (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"content": "x"}]}, "messages[0].role"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    (CHAT, {"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    (CHAT, {"messages": USER, "logprobs": True, "top_logprobs": 30}, "top_logprobs"),
    (CHAT, {"messages": USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    (CHAT, {"messages": USER, "tool_choice": "required"}, "tool_choice"),
    (CHAT, {"messages": USER, "tools": [{"function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    (CHAT, {"messages": USER, "tools": [{"function": {"name": "f"}}], "tool_choice": "required",
            "guided_regex": "a"}, "tool_choice"),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, "response_format.type"),
    (CHAT, {"messages": USER, "structured_outputs": {"grammar": "start: nope"}},
     "structured_outputs.grammar"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "[a-"}, "structured_outputs.regex"),
    (COMPLETIONS, {"prompt": "x", "guided_json": {"type": "strin"}},
     "structured_outputs.json_schema"),
    (COMPLETIONS, {"prompt": "x", "guided_json": {"type": "object"}, "guided_regex": "a"},
     "guided_regex"),
    (COMPLETIONS, {"prompt": "x", "guided_regex": "a", "guided_decoding_backend": "xgrammar"},
     "guided_decoding_backend"),
    (COMPLETIONS, {"prompt": "x", "guided_choice": "yes"}, "guided_choice"),
    (CHAT, {"messages": USER, "stream_options": {"include_usage": "maybe"}},
     "stream_options.include_usage"),
    ("/tokenize", {"prompt": ""}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "field"), BAD_FIELDS,
                         ids=[f"{p}-{f}-{i}" for i, (p, _, f) in enumerate(BAD_FIELDS)])
def test_bad_field_is_400_naming_it(http, path, body, field):
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert field in error["message"], error
    assert error["type"] == "invalid_request_error"
    assert error["param"] == field or error["param"].startswith((f"{field}[", f"{field}.")), error
    assert error["code"], error  # a reason


def test_error_statuses(http):
    unknown = http.post(COMPLETIONS, json={"model": "gpt-4o", "prompt": "x"})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "MODEL_NOT_FOUND"
    assert http.post("/v1/audio/transcriptions", json={}).status_code == 404
    missing = http.post("/v1/embeddings", json={})  # served now: a body without its input
    assert missing.status_code == 400 and missing.json()["error"]["param"] == "input"
    assert "error" in http.get("/v1/nothing").json()
    not_json = http.post(COMPLETIONS, content=b"{oops", headers={"content-type": "application/json"})
    assert not_json.status_code == 400 and not_json.json()["error"]["param"] == "body"
    huge = http.post(COMPLETIONS, json={"prompt": "x" * (17 << 20)})
    assert huge.status_code == 413 and "bytes" in huge.json()["error"]["message"]
    chunked = http.post(COMPLETIONS, content=iter([b"[" * (9 << 20)] * 2),
                        headers={"content-type": "application/json"})  # no Content-Length
    assert chunked.status_code == 413, chunked.text


def test_health_models_tokenize_detokenize(http):
    assert http.get("/health").status_code == 200
    assert http.get("/v1/models").json()["data"][0]["id"] == "tiny-llama"
    tokens = http.post("/tokenize", json={"prompt": "hello world"}).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] > 0
    chat_tokens = http.post("/tokenize", json={"messages": USER}).json()
    assert chat_tokens["count"] > tokens["count"]
    plain = http.post("/tokenize", json={"prompt": "hello world", "add_special_tokens": False})
    text = http.post("/detokenize", json={"tokens": plain.json()["tokens"]}).json()["prompt"]
    assert text == "hello world"


def _events(lines) -> list[dict | str]:
    return [line[6:] if line == "data: [DONE]" else json.loads(line[6:])
            for line in lines if line.startswith("data: ")]


def test_stream_is_server_sent_events(http):
    with http.stream("POST", CHAT, json={"messages": USER, "stream": True, "max_tokens": 3}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = _events(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")


def test_client_leaving_a_stream_aborts_its_request(stack, http):
    with http.stream("POST", COMPLETIONS, json={"prompt": "abc", "stream": True, **LONG}) as r:
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
        assert stack.load().num_gpu_blocks_used > 0
    assert_idle(stack, timeout_s=15)


def test_client_leaving_a_whole_request_aborts_it(stack, http):
    with pytest.raises(httpx.ReadTimeout):
        http.post(COMPLETIONS, json={"prompt": "abc", **LONG}, timeout=0.5)
    assert_idle(stack, timeout_s=15)


def test_64_concurrent_streaming_clients_all_complete(stack):
    async def one(client: httpx.AsyncClient, i: int) -> tuple[str, list]:
        body = {"messages": [{"role": "user", "content": f"client {i}"}], "stream": True,
                "max_tokens": 6, "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with client.stream("POST", CHAT, json=body) as r:
            assert r.status_code == 200
            events = _events([line async for line in r.aiter_lines()])
        return events[0]["id"], events

    async def main():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=120, limits=limits) as c:
            return await asyncio.gather(*(one(c, i) for i in range(64)))

    results = asyncio.run(main())
    assert len({request_id for request_id, _ in results}) == 64
    for _, events in results:
        assert events[-1] == "[DONE]"
        assert events[-2]["usage"]["completion_tokens"] == 6
        assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert_idle(stack, timeout_s=15)


# --- API key, admission limit, draining ---------------------------------------------------------


@pytest.fixture(scope="module")
def guarded(tiny_served_model_dir):
    stack = start_stack(tiny_config(tiny_served_model_dir), max_concurrent_requests=2,
                        http=HttpConfig(http_port=-1, api_key=KEY))
    yield stack
    stack.close()


def test_api_key_guards_http(guarded):
    url = guarded.http_url
    body = {"prompt": "x", "max_tokens": 2}
    missing = httpx.post(f"{url}{COMPLETIONS}", json=body)
    assert missing.status_code == 401
    assert missing.json()["error"]["code"] == "UNAUTHENTICATED"
    wrong = httpx.post(f"{url}{COMPLETIONS}", json=body, headers={"Authorization": "Bearer no"})
    assert wrong.status_code == 401
    assert httpx.get(f"{url}/v1/models").status_code == 401
    assert httpx.get(f"{url}/v1/anything").status_code == 401
    assert httpx.get(f"{url}/health").status_code == 200
    good = httpx.post(f"{url}{COMPLETIONS}", json=body, headers={"Authorization": f"Bearer {KEY}"})
    assert good.status_code == 200, good.text


def test_api_key_guards_grpc(guarded):
    request = gateway_pb2.GenerateRequest(
        text="x", sampling=common_pb2.SamplingParams(max_tokens=2))
    with grpc.insecure_channel(guarded.gateway_address) as channel:
        generation = gateway_pb2_grpc.GenerationServiceStub(channel)
        with pytest.raises(grpc.RpcError) as exc:
            generation.Generate(request, timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            list(generation.GenerateStream(request, timeout=30,
                                           metadata=[("authorization", "Bearer wrong")]))
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as exc:
            gateway_pb2_grpc.ModelServiceStub(channel).GetModelInfo(
                gateway_pb2.GetModelInfoRequest(), timeout=30)
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        response = generation.Generate(request, timeout=30,
                                       metadata=[("authorization", f"Bearer {KEY}")])
        assert len(response.outputs[0].token_ids) >= 1
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(),
                                                            timeout=30)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_grpc_abort_by_the_same_caller_ends_an_http_stream(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=guarded.http_url, headers=headers, timeout=60) as http, \
            http.stream("POST", COMPLETIONS, json={"prompt": "abc", "stream": True, **LONG}) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        request_id = json.loads(next(lines)[6:])["id"]
        with grpc.insecure_channel(guarded.gateway_address) as channel:
            gateway_pb2_grpc.GenerationServiceStub(channel).Abort(
                gateway_pb2.AbortRequest(request_id=request_id), timeout=30,
                metadata=[("authorization", f"Bearer {KEY}")])
        events = _events(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "abort"
    assert_idle(guarded, timeout_s=15)


def test_past_the_limit_is_429_then_draining_is_503(guarded):
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": "abc", "stream": True, **LONG}
    with httpx.Client(base_url=guarded.http_url, headers=headers, timeout=60) as http:
        with http.stream("POST", COMPLETIONS, json=body) as first, \
                http.stream("POST", COMPLETIONS, json=body) as second:
            assert first.status_code == second.status_code == 200
            refused = http.post(COMPLETIONS, json={"prompt": "x"})
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["type"] == "rate_limit_error"
        assert_idle(guarded, timeout_s=15)

        async def drain():
            guarded.gateway.admission.start_draining()

        guarded.loop.run(drain())
        assert http.get("/health").status_code == 503
        draining = http.post(COMPLETIONS, json={"prompt": "x"})
        assert draining.status_code == 503, draining.text
        assert "shutting down" in draining.json()["error"]["message"]


def test_scheduler_gone_is_503(tiny_served_model_dir):
    """After failover_timeout_s without a serving replica (half a second here: a test of the
    answer, not of the wait, which tests/unit/test_gateway_servicer.py times)."""
    stack = start_stack(tiny_config(tiny_served_model_dir),
                        routing=RoutingConfig(failover_timeout_s=0.5))
    try:
        stack.loop.run(stop_scheduler(*stack.scheduler))
        with httpx.Client(base_url=stack.http_url, timeout=60) as http:
            assert http.get("/health").status_code == 503
            for body in ({"prompt": "x"}, {"prompt": "x", "stream": True}):
                response = http.post(COMPLETIONS, json=body)
                assert response.status_code == 503, response.text
                assert "scheduler" in response.json()["error"]["message"]
            assert http.post(CHAT, json={"messages": USER, "stream": True}).status_code == 503
    finally:
        stack.close()
