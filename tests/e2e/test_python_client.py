"""pagedserve.Client against a real stack (worker, scheduler, gateway over loopback, a tiny
random-weight Llama): every call, deadlines, cancellation, abort and the rich error details."""

import asyncio
import threading

import grpc
import pytest
from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.app import start_gateway
from pagedserve.services.gateway.config import GatewayConfig, HttpConfig

from pagedserve import AsyncClient, Client, ClientError, RetryPolicy
from tests.e2e.stack import assert_idle, start_stack, tiny_config

LONG = {"temperature": 0.0, "max_tokens": 480, "ignore_eos": True}  # runs for many steps


@pytest.fixture()
def client(stack):
    with Client(stack.gateway_address, timeout_s=60) as client:
        yield client


def test_generate_and_stream_give_the_same_greedy_output(client):
    done = client.generate([1, 57, 300, 12], temperature=0.0, max_tokens=12, ignore_eos=True)
    assert len(done.outputs) == 1 and len(done.outputs[0].token_ids) == 12
    assert done.outputs[0].finish_reason == FinishReason.LENGTH
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (4, 12)
    with client.stream([1, 57, 300, 12], sampling=SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True)) as stream:
        deltas = list(stream)
    assert [t for d in deltas for t in d.token_ids] == done.outputs[0].token_ids
    assert "".join(d.text for d in deltas) == done.text
    assert deltas[-1].finish_reason == FinishReason.LENGTH and deltas[-1].usage == done.usage
    assert {d.request_id for d in deltas} == {stream.request_id}


def test_chat_tokenize_and_model_info(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    info = client.model_info()
    assert info.has_chat_template and info.vocab_size == 512 and info.max_model_len > 0
    tokenized = client.tokenize(messages=messages)
    assert tokenized.max_model_len == info.max_model_len
    assert client.tokenize("hello world").token_ids
    done = client.chat(messages, temperature=0.0, max_tokens=6, ignore_eos=True)
    assert done.usage.prompt_tokens == len(tokenized.token_ids)
    streamed = list(client.chat(messages, stream=True, temperature=0.0, max_tokens=6,
                                ignore_eos=True))
    assert "".join(d.text for d in streamed) == done.text


def test_abort_ends_the_stream_with_abort_and_then_is_not_found(stack, client):
    stream = client.stream([5, 6, 7], request_id="client-abort", **LONG)
    first = next(stream)
    assert first.finish_reason is None
    client.abort("client-abort")
    assert list(stream)[-1].finish_reason == FinishReason.ABORT
    with pytest.raises(ClientError) as info:
        client.abort("client-abort")
    assert info.value.code == grpc.StatusCode.NOT_FOUND and "client-abort" in info.value.message
    assert_idle(stack)


def test_closing_a_stream_cancels_the_call_and_aborts_the_request(stack, client):
    with client.stream([1, 2, 3, 4], **LONG) as stream:
        for _, delta in zip(range(3), stream, strict=False):
            assert delta.finish_reason is None
        assert stack.load().num_gpu_blocks_used > 0
    assert list(stream) == []  # a cancelled stream ends, it does not raise
    assert_idle(stack)


def test_a_deadline_fails_the_call_with_deadline_exceeded_and_frees_the_request(stack, client):
    with pytest.raises(ClientError) as info:
        client.generate([1, 2, 3], timeout_s=0.5, **LONG)
    assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert info.value.num_attempts == 1  # not a retryable code
    assert_idle(stack, timeout_s=10)


def test_invalid_argument_names_the_field_in_a_field_violation(client):
    with pytest.raises(ClientError) as info:
        client.generate([3] * 600, max_tokens=4)
    error = info.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and "max_model_len" in error.message
    assert error.num_attempts == 1
    assert error.domain == "pagedserve" and error.reason
    assert error.field_violations and all(v.field and v.description
                                          for v in error.field_violations)


def test_bad_sampling_keywords_fail_before_any_call(client):
    with pytest.raises(ValueError, match="temperature"):
        client.generate("hi", temperature=-1.0)
    with pytest.raises(ValueError, match="max_token"):
        client.generate("hi", max_token=3)


def test_resource_exhausted_is_retried_after_the_servers_retry_delay(tiny_served_model_dir,
                                                                     caplog):
    stack = start_stack(tiny_config(tiny_served_model_dir), max_concurrent_requests=1)
    try:
        with Client(stack.gateway_address, timeout_s=60, retry=None) as plain, \
                Client(stack.gateway_address, timeout_s=60, retry=RetryPolicy(
                    max_attempts=1000, initial_backoff_s=0.05, max_backoff_s=0.1)) as retrying:
            holder = plain.stream([1, 2, 3], **LONG)
            next(holder)  # the one admission slot is taken
            with pytest.raises(ClientError) as refused:
                plain.generate([4, 5], max_tokens=2)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert refused.value.retry_delay_s is not None and refused.value.retry_delay_s > 0
            result: list = []
            caplog.set_level("INFO", logger="pagedserve.client.retry")
            waiter = threading.Thread(target=lambda: result.append(retrying.generate(
                [4, 5], temperature=0.0, max_tokens=2, ignore_eos=True)))
            waiter.start()
            retried = threading.Event()
            while not retried.wait(0.05):
                if any("retrying" in r.getMessage() for r in caplog.records):
                    retried.set()
            holder.cancel()  # the slot frees; a later attempt is admitted
            waiter.join(60)
        assert len(result) == 1 and len(result[0].outputs[0].token_ids) == 2
        retries = [r for r in caplog.records if "retrying" in r.getMessage()]
        errors = [r.args[1] for r in retries]
        assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in errors)
        assert [r.args[2] for r in retries] == [e.retry_delay_s for e in errors]  # honoured
    finally:
        stack.close()


def test_a_stream_that_returned_tokens_is_never_retried(tiny_served_model_dir):
    stack = start_stack(tiny_config(tiny_served_model_dir))
    try:
        with Client(stack.gateway_address, timeout_s=60) as client:
            stream = client.stream([1, 2, 3], **LONG)
            next(stream)
            stack.loop.run(stack.gateway.stop(grace_s=0))
            with pytest.raises(ClientError) as info:
                list(stream)
        assert info.value.code == grpc.StatusCode.UNAVAILABLE
        assert info.value.num_attempts == 1
    finally:
        stack.close()


def test_async_client_generate_stream_chat_tokenize_and_model_info(stack):
    async def main():
        async with AsyncClient(stack.gateway_address, timeout_s=60) as client:
            done = await client.generate([9, 8, 7], temperature=0.0, max_tokens=5,
                                         ignore_eos=True)
            deltas = [d async for d in client.stream([9, 8, 7], temperature=0.0, max_tokens=5,
                                                     ignore_eos=True)]
            messages = [{"role": "user", "content": "Hi"}]
            chat = await client.chat(messages, temperature=0.0, max_tokens=4, ignore_eos=True)
            chat_deltas = [d async for d in await client.chat(
                messages, stream=True, temperature=0.0, max_tokens=4, ignore_eos=True)]
            return (done, deltas, chat, chat_deltas, await client.tokenize("hello"),
                    await client.model_info())

    done, deltas, chat, chat_deltas, tokenized, info = asyncio.run(main())
    assert [t for d in deltas for t in d.token_ids] == done.outputs[0].token_ids
    assert len(done.outputs[0].token_ids) == 5
    assert "".join(d.text for d in chat_deltas) == chat.text
    assert chat.outputs[0].finish_reason == FinishReason.LENGTH
    assert tokenized.token_ids and tokenized.max_model_len == info.max_model_len


def test_async_cancelling_the_reading_task_aborts_the_request(stack):
    async def main():
        async with AsyncClient(stack.gateway_address, timeout_s=60) as client:
            started = asyncio.Event()

            async def read():
                async for _ in client.stream([1, 2, 3], **LONG):
                    started.set()

            task = asyncio.create_task(read())
            await started.wait()
            assert stack.load().num_running_requests == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(main())
    assert_idle(stack)


def test_async_abort_deadline_and_errors(stack):
    async def main():
        async with AsyncClient(stack.gateway_address, timeout_s=60) as client:
            stream = client.stream([5, 6], request_id="async-abort", **LONG)
            await anext(stream)
            await client.abort("async-abort")
            rest = [d async for d in stream]
            with pytest.raises(ClientError) as late:
                await client.generate([1, 2], timeout_s=0.5, **LONG)
            return rest, late.value

    rest, late = asyncio.run(main())
    assert rest[-1].finish_reason == FinishReason.ABORT
    assert late.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_idle(stack, timeout_s=10)


def test_the_cli_generates_and_chats_through_the_client(stack, client, capsys):
    from pagedserve.cli import main

    flags = ["--address", stack.gateway_address, "--max-tokens", "4", "--temperature", "0",
             "--ignore-eos"]
    assert main(["generate", "hello", *flags]) == 0
    out, err = capsys.readouterr()
    assert out == client.generate("hello", temperature=0.0, max_tokens=4,
                                  ignore_eos=True).text + "\n"
    assert "finish: length; prompt" in err
    assert main(["chat", "Hi", "--system", "Be brief.", *flags]) == 0
    assert "finish: length" in capsys.readouterr().err
    assert main(["generate", "x" * 3000, *flags]) == 1
    assert "error: INVALID_ARGUMENT: " in capsys.readouterr().err


def test_the_api_key_goes_in_the_authorization_metadata(stack):
    gateway = stack.loop.run(start_gateway(GatewayConfig(
        port=0, scheduler_address=stack.scheduler_address,
        http=HttpConfig(http_port=-1, api_key="sesame"))))
    try:
        address = f"127.0.0.1:{gateway.port}"
        with Client(address, timeout_s=30) as anonymous, pytest.raises(ClientError) as info:
            anonymous.model_info()
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert info.value.num_attempts == 1
        with Client(address, api_key="sesame", timeout_s=30) as client:
            assert client.model_info().vocab_size == 512
            assert len(client.generate("hi", max_tokens=2, ignore_eos=True)
                       .outputs[0].token_ids) == 2
    finally:
        stack.loop.run(gateway.stop(grace_s=0))
