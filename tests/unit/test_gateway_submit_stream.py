"""The gateway's SubmitStream client hands a request's responses to its handler in the call's
reader: the request ends where the handler says, where it raises, or at the scheduler's end, and
only a request the gateway leaves is cancelled in the scheduler."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from pagedserve.services.common.errors import PagedServeError, Reason, Unavailable
from pagedserve.services.gateway.submit_stream import RESPONSE_WINDOW, SubmitStreamClient
from pagedserve.services.gateway.validation import ServedModel
from pagedserve.services.rpc.internal.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

from tests.unit.fake_scheduler import FakeScheduler, start_fake_scheduler

REPLY_IDS = [11, 12, 13, 14, 15, 16]


def run(body, hang: bool = False):
    async def main():
        info = ServedModel("tiny", "LlamaForCausalLM", 64, 100, (2,), False)
        fake = FakeScheduler("tiny", info, REPLY_IDS)
        fake.hang = hang
        server = await start_fake_scheduler(fake)
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")
        client = SubmitStreamClient(scheduler_pb2_grpc.SchedulerServiceStub(channel), "fake",
                                    1.0)
        try:
            return await asyncio.wait_for(body(client, fake), 10), fake
        finally:
            await client.close()
            await channel.close()
            await server.shutdown(grace_s=0)

    return asyncio.run(main())


def submit(request_id: str, max_tokens: int = 6) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7],
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))


def test_a_request_run_to_its_end_is_not_cancelled():
    async def body(client, fake):
        tokens = []

        def on_response(response):
            tokens.extend(response.outputs[0].token_ids)
            return False

        return await client.stream(submit("r"), on_response), tokens

    (left, tokens), fake = run(body)
    assert left is False
    assert tokens == REPLY_IDS
    assert fake.cancelled == set()


def test_the_call_asks_for_one_response_at_a_time_and_acknowledges_every_one_it_handled():
    """One unacknowledged response: what the scheduler makes while the gateway handles it
    comes merged in the next, so a gateway behind its engine gets several tokens per event."""
    async def body(client, fake):
        await client.stream(submit("r"), lambda response: False)
        while fake.num_handled_responses < fake.num_responses:
            await asyncio.sleep(0.01)

    _, fake = run(body)
    assert fake.response_window == RESPONSE_WINDOW == 1
    assert fake.num_handled_responses == fake.num_responses >= len(REPLY_IDS)


def test_a_handler_that_leaves_cancels_the_request_in_the_scheduler():
    async def body(client, fake):
        tokens = []

        def on_response(response):
            tokens.extend(response.outputs[0].token_ids)
            return len(tokens) == 2

        left = await client.stream(submit("r"), on_response)
        await asyncio.wait_for(fake.any_cancelled.wait(), 5)
        return left, tokens

    (left, tokens), fake = run(body, hang=True)
    assert left is True
    assert tokens == REPLY_IDS[:2]
    assert fake.cancelled == {"r"}


def test_a_handler_that_raises_ends_its_request_with_that_error_and_others_go_on():
    async def body(client, fake):
        def failing(response):
            raise ValueError("bad output")

        tokens = []

        def on_response(response):
            tokens.extend(response.outputs[0].token_ids)
            return len(tokens) == len(REPLY_IDS)

        results = await asyncio.gather(client.stream(submit("bad"), failing),
                                       client.stream(submit("good"), on_response),
                                       return_exceptions=True)
        while fake.cancelled != {"bad", "good"}:
            await asyncio.sleep(0.01)
        return results, tokens

    (results, tokens), fake = run(body, hang=True)
    assert isinstance(results[0], ValueError)
    assert results[1] is True
    assert tokens == REPLY_IDS


def test_a_cancelled_task_cancels_its_request():
    async def body(client, fake):
        seen = asyncio.Event()

        def on_response(response):
            seen.set()
            return False

        task = asyncio.create_task(client.stream(submit("r"), on_response))
        await seen.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(fake.any_cancelled.wait(), 5)

    _, fake = run(body, hang=True)
    assert fake.cancelled == {"r"}


def test_a_call_broken_under_an_acknowledgement_fails_its_requests_as_unavailable():
    """grpc.aio fails a write to a call that has just ended with INTERNAL, over the status the
    scheduler's end gave: the gateway must still see an unavailable scheduler, whose requests
    it resubmits elsewhere (the acknowledgement after the first event races the break: most
    requests see the write's INTERNAL, a few the call's own UNAVAILABLE)."""
    async def body(client, fake):
        fake.break_after = 2
        outcomes = []
        for i in range(20):
            with pytest.raises(PagedServeError) as err:
                await client.stream(submit(f"r{i}", max_tokens=6), lambda response: False)
            outcomes.append((type(err.value), err.value.reason))
        return outcomes

    outcomes, _ = run(body)
    assert {error for error, _ in outcomes} == {Unavailable}  # failover resubmits these
    assert (Unavailable, Reason.SCHEDULER_UNAVAILABLE) in outcomes  # the write's INTERNAL
