"""Rich errors at the gateway's doors, read as a client in any language would: the
google.rpc.Status in the trailers (grpc_status.rpc_status.from_call), and OpenAI's error body.
Every INVALID_ARGUMENT path of the gRPC API names its fields (BadRequest) and its reason
(ErrorInfo); RESOURCE_EXHAUSTED and UNAVAILABLE say when to retry (RetryInfo)."""

import asyncio

import grpc
import httpx
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status
from pagedserve.scheduler_svc.request_checks import RequestLimits
from pagedserve.services.common.drain_rate import DrainRate
from pagedserve.services.common.errors import Reason
from pagedserve.services.gateway.config import HttpConfig, RequestLimitsConfig, RoutingConfig
from pagedserve.services.gateway.scheduler_client import SCHEDULER_RETRY_AFTER_S
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2

from tests.unit.test_gateway_servicer import MAX_MODEL_LEN, collect, harness
from tests.unit.tiny_tokenizers import byte_level_bpe

VOCAB_SIZE = byte_level_bpe().vocab_size
LONG_TEXT = "the quick brown fox jumps over the lazy dog " * 12  # > MAX_MODEL_LEN tokens
CHAR_LIMIT = 2 * MAX_MODEL_LEN * byte_level_bpe().max_token_chars


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    """The served folder: with a chat template, and without one."""
    dirs = {}
    for name, template in (("chat", byte_level_bpe().hf_tokenizer.chat_template), ("plain", None)):
        path = tmp_path_factory.mktemp(name)
        hf = byte_level_bpe().hf_tokenizer
        saved, hf.chat_template = hf.chat_template, template
        try:
            hf.save_pretrained(path)
        finally:
            hf.chat_template = saved
        dirs[name] = str(path)
    return dirs


def streamed(request: gateway_pb2.GenerateRequest) -> gateway_pb2.GenerateStreamRequest:
    """The same request for GenerateStream (the same fields, the same numbers)."""
    return gateway_pb2.GenerateStreamRequest.FromString(request.SerializeToString())


def text(prompt="the quick brown fox", **sampling):
    return gateway_pb2.GenerateRequest(text=prompt,
                                       sampling=common_pb2.SamplingParams(**sampling))


def ids(token_ids, **sampling):
    return gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=token_ids),
                                       sampling=common_pb2.SamplingParams(**sampling))


def chat(*messages, **sampling):
    return gateway_pb2.GenerateRequest(
        messages=common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role=role, content=content) for role, content in messages]),
        sampling=common_pb2.SamplingParams(**sampling))


BAD = Reason.INVALID_SAMPLING_PARAMS
OVER = Reason.LIMIT_EXCEEDED
# (request, [(field path in GenerateRequest, reason)], harness options)
GENERATE_CASES = [
    (text(""), [("text", Reason.PROMPT_EMPTY)], {}),
    (gateway_pb2.GenerateRequest(), [("prompt", Reason.PROMPT_MISSING)], {}),
    (ids([]), [("token_ids.token_ids", Reason.PROMPT_EMPTY)], {}),
    (ids([1, VOCAB_SIZE, 2, VOCAB_SIZE + 7]),
     [("token_ids.token_ids[1]", Reason.UNKNOWN_TOKEN_ID),
      ("token_ids.token_ids[3]", Reason.UNKNOWN_TOKEN_ID)], {}),
    (text("a" * (CHAR_LIMIT + 1)), [("text", Reason.PROMPT_TOO_LONG)], {}),
    (chat(("user", "a" * (CHAR_LIMIT + 1))), [("messages.messages", Reason.PROMPT_TOO_LONG)], {}),
    (chat(("user", "hi")), [("messages.messages", Reason.NO_CHAT_TEMPLATE)], {"dir": "plain"}),
    (chat(), [("messages.messages", Reason.PROMPT_EMPTY)], {}),
    (chat(("robot", "hi")), [("messages.messages[0].role", Reason.INVALID_CHAT_MESSAGE)], {}),
    (chat(("user", "hi"), ("assistant", "")),
     [("messages.messages[1].content", Reason.INVALID_CHAT_MESSAGE)], {}),
    (gateway_pb2.GenerateRequest(request_id="r" * 257, text="x"),
     [("request_id", Reason.INVALID_REQUEST_ID)], {}),
    (text(temperature=-1.0, top_p=0.0), [("sampling.temperature", BAD), ("sampling.top_p", BAD)], {}),
    (text(temperature=float("nan")), [("sampling.temperature", BAD)], {}),
    (text(top_k=-5, min_p=2.0), [("sampling.top_k", BAD), ("sampling.min_p", BAD)], {}),
    (text(presence_penalty=3.0, frequency_penalty=-3.0, repetition_penalty=0.0),
     [("sampling.presence_penalty", BAD), ("sampling.frequency_penalty", BAD),
      ("sampling.repetition_penalty", BAD)], {}),
    (text(length_penalty=11.0), [("sampling.length_penalty", BAD)], {}),
    (text(max_tokens=0), [("sampling.max_tokens", BAD)], {}),
    (text(max_tokens=4, min_tokens=9), [("sampling.min_tokens", BAD)], {}),
    (text(stop=["ok", ""]), [("sampling.stop[1]", BAD)], {}),
    (text(n=0), [("sampling.n", BAD)], {}),
    (text(n=2, best_of=1), [("sampling.best_of", BAD)], {}),
    (text(use_beam_search=True, temperature=0.0), [("sampling.best_of", BAD)], {}),
    (text(stop_token_ids=[5, VOCAB_SIZE]),
     [("sampling.stop_token_ids[1]", Reason.UNKNOWN_TOKEN_ID)], {}),
    (text(logprobs=21), [("sampling.logprobs", BAD)], {}),
    (text(logprobs=6), [("sampling.logprobs", OVER)], {"limits": RequestLimitsConfig(max_logprobs=5)}),
    (text(prompt_logprobs=6), [("sampling.prompt_logprobs", OVER)],
     {"limits": RequestLimitsConfig(max_logprobs=5)}),
    (text(n=9), [("sampling.n", OVER)], {"limits": RequestLimitsConfig(max_num_seqs_per_request=8)}),
    (text(best_of=9), [("sampling.best_of", OVER)],
     {"limits": RequestLimitsConfig(max_num_seqs_per_request=8)}),
    (text(stop=["s"] * 65), [("sampling.stop", OVER)], {}),
    (text(stop=["s" * 257]), [("sampling.stop[0]", OVER)], {}),
    (chat(("user", "a"), ("assistant", "b"), ("user", "c")), [("messages.messages", OVER)],
     {"limits": RequestLimitsConfig(max_chat_messages=2)}),
    (ids([1] * 300), [("token_ids.token_ids", OVER)],
     {"limits": RequestLimitsConfig(max_request_bytes=1000)}),
    (text(max_tokens=MAX_MODEL_LEN), [("sampling.max_tokens", Reason.MAX_TOKENS_TOO_LARGE)], {}),
    (ids([1] * 60, max_tokens=10), [("sampling.max_tokens", Reason.MAX_TOKENS_TOO_LARGE)], {}),
    (ids([1] * MAX_MODEL_LEN, max_tokens=1), [("token_ids.token_ids", Reason.PROMPT_TOO_LONG)],
     {}),
    (text(LONG_TEXT, max_tokens=1), [("text", Reason.PROMPT_TOO_LONG)], {}),
    (text(max_tokens=50, n=2), [("sampling.max_tokens", Reason.KV_CACHE_TOO_SMALL),
                                ("sampling.n", Reason.KV_CACHE_TOO_SMALL)],
     {"capacity": (16, 4, 8)}),
    # refused by the scheduler (its max_best_of), passed through by the gateway
    (text(n=3), [("sampling.n", OVER)], {"scheduler_max_best_of": 2}),
]
TOKENIZE_CASES = [
    (gateway_pb2.TokenizeRequest(), [("prompt", Reason.PROMPT_MISSING)]),
    (gateway_pb2.TokenizeRequest(text=""), [("text", Reason.PROMPT_EMPTY)]),
    (gateway_pb2.TokenizeRequest(messages=common_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="robot", content="hi")])),
     [("messages.messages[0].role", Reason.INVALID_CHAT_MESSAGE)]),
]


def scheduler_limits(max_best_of: int) -> RequestLimits:
    return RequestLimits(vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, block_size=16,
                         num_usable_blocks=1000, max_best_of=max_best_of, max_num_seqs=256,
                         max_waiting_requests=100)


def rich(err: grpc.aio.AioRpcError):
    """The status's ErrorInfo, BadRequest and RetryInfo (None where absent)."""
    status = rpc_status.from_call(err)
    assert status is not None, "no google.rpc.Status in the trailers"
    found = {}
    for kind in (error_details_pb2.ErrorInfo, error_details_pb2.BadRequest,
                 error_details_pb2.RetryInfo):
        for detail in status.details:
            if detail.Is(kind.DESCRIPTOR):
                found[kind] = kind()
                detail.Unpack(found[kind])
    return (found.get(error_details_pb2.ErrorInfo), found.get(error_details_pb2.BadRequest),
            found.get(error_details_pb2.RetryInfo))


def run_with(model_dirs, options, body):
    options = dict(options)
    model_dir = model_dirs[options.pop("dir", "chat")]
    max_best_of = options.pop("scheduler_max_best_of", None)
    if options.pop("with_http", False):
        options["http"] = HttpConfig(http_port=-1)

    async def main():
        async with harness(model_dir, **options) as h:
            if max_best_of is not None:
                h.fake.limits = scheduler_limits(max_best_of)
            return await asyncio.wait_for(body(h), 20)

    return asyncio.run(main())


def assert_bad_request(err, expected):
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    info, bad_request, retry = rich(err)
    got = [(v.field, info.reason) for v in bad_request.field_violations]
    assert got == [(field, str(reason)) for field, reason in expected], err.details()
    assert info.domain == "pagedserve"
    assert info.metadata["field"] == expected[0][0]
    assert all(v.description for v in bad_request.field_violations)
    assert retry is None


@pytest.mark.parametrize("req, expected, options", GENERATE_CASES,
                         ids=[f"{i}-{e[0][0]}-{e[0][1]}" for i, (_, e, _) in
                              enumerate(GENERATE_CASES)])
def test_every_invalid_generate_request_names_its_fields_and_reason(model_dirs, req, expected,
                                                                     options):
    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as streaming:
            await collect(h.generation.GenerateStream(streamed(req), timeout=10))
        with pytest.raises(grpc.aio.AioRpcError) as unary:
            await h.generation.Generate(req, timeout=10)
        return streaming.value, unary.value, h.fake.submits

    streaming, unary, submits = run_with(model_dirs, options, body)
    assert_bad_request(streaming, expected)
    assert_bad_request(unary, expected)
    assert submits == []


@pytest.mark.parametrize("req, expected", TOKENIZE_CASES)
def test_invalid_tokenize_and_abort_requests_name_their_fields(model_dirs, req, expected):
    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as tokenize:
            await h.generation.Tokenize(req, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as abort:
            await h.generation.Abort(gateway_pb2.AbortRequest(request_id=""), timeout=10)
        return tokenize.value, abort.value

    tokenize, abort = run_with(model_dirs, {}, body)
    assert_bad_request(tokenize, expected)
    assert_bad_request(abort, [("request_id", Reason.INVALID_REQUEST_ID)])


def test_malformed_request_has_a_reason_and_no_field(model_dirs):
    async def body(h):
        call = h.channel.unary_stream("/pagedserve.v1.GenerationService/GenerateStream")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(call(b"\x12\x05\xff\xfe\xfd\xfc\xfb", timeout=10))
        return err.value

    err = run_with(model_dirs, {}, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    info, bad_request, _ = rich(err)
    assert info.reason == Reason.MALFORMED_REQUEST and bad_request is None


def test_unknown_request_id_is_not_found_with_its_reason(model_dirs):
    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.generation.Abort(gateway_pb2.AbortRequest(request_id="nope"), timeout=10)
        return err.value

    err = run_with(model_dirs, {}, body)
    assert err.code() == grpc.StatusCode.NOT_FOUND
    info, _, _ = rich(err)
    assert (info.reason, info.metadata["field"]) == (Reason.REQUEST_NOT_FOUND, "request_id")


def test_rate_limited_carries_retry_info_on_grpc_and_http(model_dirs):
    """max_concurrent_requests=1: the second request is refused, on both doors, with the time
    it should wait (a default before any request finished)."""
    async def body(h):
        h.fake.hang = True
        first = h.generation.GenerateStream(streamed(text(max_tokens=40)), timeout=10)
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(streamed(text()), timeout=10))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.gateway.http_port}") as http:
            response = await http.post("/v1/completions", json={"prompt": "x"}, timeout=10)
        first.cancel()
        return err.value, response

    err, response = run_with(model_dirs, {"max_concurrent_requests": 1, "with_http": True}, body)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    info, _, retry = rich(err)
    assert info.reason == Reason.RATE_LIMITED
    assert info.metadata["limit_name"] == "max_concurrent_requests"
    assert retry.retry_delay.ToNanoseconds() > 0
    assert response.status_code == 429
    assert response.json()["error"]["code"] == "RATE_LIMITED"
    assert int(response.headers["Retry-After"]) >= 1


def test_queue_full_from_the_scheduler_passes_through_with_retry_info(model_dirs):
    """The scheduler's QUEUE_FULL (its own details: reason, Retry-After from how fast its
    requests finish) reaches the client as the scheduler sent it."""
    async def body(h):
        h.fake.limits = RequestLimits(
            vocab_size=VOCAB_SIZE, max_model_len=MAX_MODEL_LEN, block_size=16,
            num_usable_blocks=1000, max_best_of=8, max_num_seqs=8, max_waiting_requests=1)
        h.fake.drain_rate = DrainRate(clock=iter([100.0, 100.5, 101.0]).__next__)
        for _ in range(3):  # requests finished every 0.5 s
            h.fake.drain_rate.record()
        h.fake.hang = True
        first = h.generation.GenerateStream(streamed(text(max_tokens=40)), timeout=10)
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(streamed(text()), timeout=10))
        first.cancel()
        return err.value

    err = run_with(model_dirs, {}, body)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting_requests" in err.details()
    info, _, retry = rich(err)
    assert (info.reason, info.domain) == (Reason.QUEUE_FULL, "pagedserve")
    assert info.metadata["limit"] == "1"
    assert retry.retry_delay.ToNanoseconds() == 500_000_000


def test_no_scheduler_is_unavailable_with_retry_info(model_dirs):
    async def body(h):
        await h.stop_scheduler()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(streamed(text(max_tokens=4)), timeout=10))
        return err.value

    err = run_with(model_dirs, {"routing": RoutingConfig(failover_timeout_s=0.2)}, body)
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    info, _, retry = rich(err)
    assert info.reason == Reason.SCHEDULER_UNAVAILABLE
    assert retry.retry_delay.ToNanoseconds() == SCHEDULER_RETRY_AFTER_S * 1e9


@pytest.mark.parametrize("path, body, status, code, param", [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400,
     Reason.INVALID_SAMPLING_PARAMS, "temperature"),
    ("/v1/completions", {"prompt": [7, VOCAB_SIZE]}, 400, Reason.UNKNOWN_TOKEN_ID, "prompt[1]"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400,
     Reason.MAX_TOKENS_TOO_LARGE, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "stop": ["a", ""]}, 400, Reason.INVALID_SAMPLING_PARAMS,
     "stop[1]"),
    ("/v1/completions", {"prompt": "x", "cache_salt": "pepper"}, 400,
     Reason.UNSUPPORTED_PARAMETER, "cache_salt"),
    ("/v1/completions", {"prompt": "x", "seed": "abc"}, 400, Reason.INVALID_BODY, "seed"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "x"}, 404, Reason.MODEL_NOT_FOUND, "model"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
     400, Reason.INVALID_CHAT_MESSAGE, "messages[0].content[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, 400,
     Reason.INVALID_BODY, "messages[0].role"),
])
def test_openai_error_bodies_carry_the_reason(model_dirs, path, body, status, code, param):
    async def main(h):
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{h.gateway.http_port}") as http:
            return await http.post(path, json=body, timeout=10)

    response = run_with(model_dirs, {"with_http": True}, main)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert (error["code"], error["param"]) == (code, param)


def test_a_failed_generation_is_internal_with_its_reason(model_dirs):
    async def body(h):
        h.fake.error = "worker 0 crashed"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await h.generation.Generate(text(max_tokens=4), timeout=10)
        return err.value

    err = run_with(model_dirs, {}, body)
    assert err.code() == grpc.StatusCode.INTERNAL
    info, bad_request, retry = rich(err)
    assert (info.reason, bad_request, retry) == (Reason.GENERATION_FAILED, None, None)
