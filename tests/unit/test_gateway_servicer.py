"""The gateway over real gRPC against a test double of the scheduler (tests/unit/fake_scheduler)."""

import asyncio
import contextlib
import gc
import time
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.services.gateway.app import Gateway, start_gateway
from pagedserve.services.gateway.config import (
    GatewayConfig,
    HttpConfig,
    RequestLimitsConfig,
    RoutingConfig,
)
from pagedserve.services.gateway.validation import ServedModel
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.unit.fake_scheduler import FakeScheduler, start_fake_scheduler
from tests.unit.tiny_tokenizers import byte_level_bpe

REPLY = "hello 你好 😀 world. STOP and more"
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tokenizer")
    tokenizer = byte_level_bpe()
    tokenizer.hf_tokenizer.save_pretrained(path)
    return str(path)


@dataclass
class Harness:
    fake: FakeScheduler
    generation: gateway_pb2_grpc.GenerationServiceStub
    models: gateway_pb2_grpc.ModelServiceStub
    channel: grpc.aio.Channel
    stop_scheduler: object
    gateway: Gateway
    fake_address: str


@contextlib.asynccontextmanager
async def harness(model_dir, max_concurrent_requests=8, max_model_len=MAX_MODEL_LEN,
                  limits=None, capacity=None, routing=None, http=None):
    """`capacity`: the replica's (block_size, num_gpu_blocks, max_num_seqs); none reported
    by default. `http`: the HTTP API's config (off by default)."""
    tokenizer = byte_level_bpe()
    block_size, num_gpu_blocks, max_num_seqs = capacity or (0, 0, 0)
    info = ServedModel(model="tiny", architecture="LlamaForCausalLM", max_model_len=max_model_len,
                       vocab_size=tokenizer.vocab_size, eos_token_ids=(2,), has_chat_template=True,
                       block_size=block_size, num_gpu_blocks=num_gpu_blocks,
                       max_num_seqs=max_num_seqs)
    fake = FakeScheduler(model_dir, info, tokenizer.encode(REPLY, add_special_tokens=False))
    scheduler_server = await start_fake_scheduler(fake)
    gateway = await start_gateway(GatewayConfig(
        port=0, scheduler_address=f"127.0.0.1:{scheduler_server.port}", rpc_timeout_s=2.0,
        max_concurrent_requests=max_concurrent_requests,
        limits=limits or RequestLimitsConfig(), http=http or HttpConfig(http_port=0),
        routing=routing or RoutingConfig()))
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{gateway.port}")
    try:
        yield Harness(fake, gateway_pb2_grpc.GenerationServiceStub(channel),
                      gateway_pb2_grpc.ModelServiceStub(channel), channel,
                      lambda: scheduler_server.shutdown(grace_s=0), gateway,
                      f"127.0.0.1:{scheduler_server.port}")
    finally:
        await channel.close()
        await gateway.stop(grace_s=0)
        await scheduler_server.shutdown(grace_s=0)
        gc.collect()  # grpc objects in cycles end with this loop, not in a later test's


def run(model_dir, body, **kw):
    async def main():
        async with harness(model_dir, **kw) as h:
            return await asyncio.wait_for(body(h), 20)

    return asyncio.run(main())


def request(**sampling):
    return gateway_pb2.GenerateStreamRequest(request_id="r1", text="the quick brown fox",
                                             sampling=common_pb2.SamplingParams(**sampling))


async def collect(call):
    return [r async for r in call]


async def read_rest(call):
    responses = []
    while (r := await call.read()) is not grpc.aio.EOF:
        responses.append(r)
    return responses


def test_stream_text_equals_reply_and_ends_with_finish_and_usage(model_dir):
    async def body(h):
        return await collect(h.generation.GenerateStream(request(max_tokens=40), timeout=10))

    responses = run(model_dir, body)
    assert "".join(r.text for r in responses) == REPLY
    assert all("\ufffd" not in r.text for r in responses)
    assert all(r.request_id == "r1" for r in responses)
    last = responses[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_STOP
    assert all(r.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED for r in responses[:-1])
    num_tokens = sum(len(r.token_ids) for r in responses)
    assert last.usage.completion_tokens == num_tokens
    assert last.usage.prompt_tokens == len(byte_level_bpe().encode("the quick brown fox"))
    assert last.usage.cached_tokens == 1


def test_max_tokens_finishes_with_length(model_dir):
    async def body(h):
        return await collect(h.generation.GenerateStream(request(max_tokens=3), timeout=10))

    responses = run(model_dir, body)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert sum(len(r.token_ids) for r in responses) == 3


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_ends_the_stream_and_cancels_the_scheduler_call(model_dir, include):
    async def body(h):
        h.fake.hang = True  # the scheduler would go on forever
        responses = await collect(h.generation.GenerateStream(
            request(max_tokens=40, stop=["STOP"], include_stop_str_in_output=include), timeout=10))
        await asyncio.wait_for(h.fake.any_cancelled.wait(), 5)
        return responses, h.fake.cancelled, h.fake.finished

    responses, cancelled, finished = run(model_dir, body)
    assert finished == [("r1", 0)]  # finished in the scheduler first, then the call left
    expected = "hello 你好 😀 world. STOP" if include else "hello 你好 😀 world. "
    assert "".join(r.text for r in responses) == expected
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert cancelled == {"r1"}


def test_each_output_a_stop_string_ended_is_finished_in_the_scheduler(model_dir):
    async def body(h):
        h.fake.hang = True
        response = await h.generation.Generate(gateway_pb2.GenerateRequest(
            request_id="r1", text="the quick brown fox",
            sampling=common_pb2.SamplingParams(max_tokens=40, n=2, temperature=1.0,
                                               stop=["STOP"])), timeout=10)
        await asyncio.wait_for(h.fake.any_cancelled.wait(), 5)  # its finishes came before
        return response, h.fake.finished

    response, finished = run(model_dir, body)
    assert sorted(finished) == [("r1", 0), ("r1", 1)]
    assert [o.finish_reason for o in response.outputs] == [common_pb2.FINISH_REASON_STOP] * 2


def test_generate_unary_aggregates_n_outputs_with_logprobs(model_dir):
    async def body(h):
        return await h.generation.Generate(gateway_pb2.GenerateRequest(
            request_id="r1", text="the quick brown fox",
            sampling=common_pb2.SamplingParams(max_tokens=40, n=2, logprobs=1)), timeout=10)

    response = run(model_dir, body)
    assert [o.index for o in response.outputs] == [0, 1]
    for output in response.outputs:
        assert output.text == REPLY
        assert output.finish_reason == common_pb2.FINISH_REASON_STOP
        assert len(output.logprobs) == len(output.token_ids) == len(output.top_logprobs)
        assert output.logprobs[0].text == byte_level_bpe().decode([output.token_ids[0]])
        assert output.cumulative_logprob == pytest.approx(-0.5 * len(output.token_ids))
    assert response.usage.completion_tokens == 2 * len(response.outputs[0].token_ids)


def test_client_deadline_cancels_the_scheduler_call(model_dir):
    async def body(h):
        h.fake.hang = True
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(request(max_tokens=40), timeout=0.5))
        await asyncio.wait_for(h.fake.any_cancelled.wait(), 5)
        return err.value.code()

    assert run(model_dir, body) == grpc.StatusCode.DEADLINE_EXCEEDED


def test_abort_forwards_to_the_scheduler_and_ends_the_stream(model_dir):
    async def body(h):
        h.fake.hang = True
        call = h.generation.GenerateStream(request(max_tokens=40), timeout=10)
        first = await call.read()
        await h.generation.Abort(gateway_pb2.AbortRequest(request_id="r1"), timeout=5)
        rest = await read_rest(call)
        with pytest.raises(grpc.aio.AioRpcError) as unknown:
            await h.generation.Abort(gateway_pb2.AbortRequest(request_id="nope"), timeout=5)
        return first, rest, unknown.value

    first, rest, unknown = run(model_dir, body)
    assert first.text
    assert unknown.code() == grpc.StatusCode.NOT_FOUND and "nope" in unknown.details()
    assert rest[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
    assert rest[-1].HasField("usage")


@pytest.mark.parametrize("req, words", [
    (gateway_pb2.GenerateStreamRequest(text=""), ["text", "''"]),
    (gateway_pb2.GenerateStreamRequest(), ["prompt must be set"]),
    (gateway_pb2.GenerateStreamRequest(token_ids=common_pb2.TokenIds()), ["token_ids", "[]"]),
    (gateway_pb2.GenerateStreamRequest(token_ids=common_pb2.TokenIds(token_ids=[1, 99999])),
     ["token_ids", "99999"]),
    (request(temperature=-1.0), ["temperature", "-1.0"]),
    (request(max_tokens=0), ["max_tokens", "0"]),
    (request(n=0), ["n must", "0"]),
    (request(logprobs=21), ["logprobs", "21"]),
    (request(stop_token_ids=[99999]), ["stop_token_ids", "99999"]),
    (request(stop=["ok", ""]), ["stop", "''"]),
    (request(max_tokens=MAX_MODEL_LEN), ["max_model_len", str(MAX_MODEL_LEN)]),
    (gateway_pb2.GenerateStreamRequest(messages=common_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="robot", content="hi")])), ["role", "robot"]),
    (gateway_pb2.GenerateStreamRequest(messages=common_pb2.ChatMessages()), ["messages", "empty"]),
])
def test_invalid_requests_name_the_field_and_value(model_dir, req, words):
    async def body(h):
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(req, timeout=5))
        return err.value, h.fake.submits

    err, submits = run(model_dir, body)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    for word in words:
        assert word in err.details()
    assert submits == []  # never reached the scheduler


def test_chat_messages_go_through_the_template(model_dir):
    async def body(h):
        messages = common_pb2.ChatMessages(messages=[
            common_pb2.ChatMessage(role="user", content="hello")])
        await collect(h.generation.GenerateStream(
            gateway_pb2.GenerateStreamRequest(messages=messages), timeout=5))
        tokenized = await h.generation.Tokenize(gateway_pb2.TokenizeRequest(messages=messages))
        return list(h.fake.submits[0].prompt_token_ids), tokenized

    prompt_ids, tokenized = run(model_dir, body)
    text = byte_level_bpe().decode(prompt_ids, skip_special_tokens=False)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert list(tokenized.token_ids) == prompt_ids
    assert tokenized.max_model_len == MAX_MODEL_LEN


def test_model_info_and_health(model_dir):
    async def body(h):
        info = await h.models.GetModelInfo(gateway_pb2.GetModelInfoRequest(), timeout=5)
        health = await health_pb2_grpc.HealthStub(h.channel).Check(
            health_pb2.HealthCheckRequest(service="pagedserve.v1.GenerationService"), timeout=5)
        return info, health.status

    info, status = run(model_dir, body)
    assert info.max_model_len == MAX_MODEL_LEN
    assert info.vocab_size == byte_level_bpe().vocab_size
    assert list(info.eos_token_ids) == [2]
    assert info.has_chat_template
    assert info.model.startswith("tokenizer")  # the served folder's name
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_engine_error_fails_the_call_with_internal(model_dir):
    async def body(h):
        h.fake.error = "worker 0 crashed"
        call = h.generation.GenerateStream(request(max_tokens=40), timeout=5)
        responses = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for r in call:
                responses.append(r)
        return responses, err.value

    responses, err = run(model_dir, body)
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_ERROR
    assert err.code() == grpc.StatusCode.INTERNAL
    assert "worker 0 crashed" in err.details()


def test_overloaded_when_too_many_requests_are_live(model_dir):
    async def body(h):
        h.fake.hang = True
        first = h.generation.GenerateStream(request(max_tokens=40), timeout=10)
        await first.read()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(
                gateway_pb2.GenerateStreamRequest(request_id="r2", text="x"), timeout=5))
        first.cancel()
        return err.value

    err = run(model_dir, body, max_concurrent_requests=1)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_concurrent_requests" in err.details()


def test_dead_scheduler_gives_unavailable_after_the_failover_timeout(model_dir):
    """A request waits failover_timeout_s for a replica to serve (a restart), then fails."""
    async def body(h):
        await h.stop_scheduler()
        start = time.monotonic()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await collect(h.generation.GenerateStream(request(max_tokens=4), timeout=10))
        return err.value, time.monotonic() - start

    err, elapsed = run(model_dir, body, routing=RoutingConfig(failover_timeout_s=0.5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "scheduler" in err.details()
    assert elapsed < 5.0
