"""Backpressure at the gateway over real gRPC (fake scheduler behind it): a client that stops
reading gets its request paused in the scheduler once it has more than max_unread_stream_tokens
unread, and resumed when it reads again, losing or repeating no token; a client that reads is
never paused."""

import asyncio

import grpc
from pagedserve.services.common.config import RequestLimitsConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.unit.test_gateway_hostile_clients import model_dir, run  # noqa: F401 (fixture)
from tests.unit.test_gateway_servicer import collect, read_rest, request

NUM_TOKENS = 3_000
MAX_UNREAD = 32


def stalled_request(request_id: str) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        request_id=request_id, token_ids=gateway_pb2.TokenIds(token_ids=[5, 6, 7]),
        sampling=common_pb2.SamplingParams(max_tokens=NUM_TOKENS, ignore_eos=True, logprobs=5))


async def wait_until(condition, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.02)


def test_an_unread_stream_is_paused_and_resumes_without_losing_a_token(model_dir):  # noqa: F811
    async def body(h):
        h.fake.num_reply_tokens = NUM_TOKENS
        # a receive window of ~1 KB: the first responses fill it, the rest wait in the gateway
        small_window = grpc.aio.insecure_channel(f"127.0.0.1:{h.gateway.port}", options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
        stalled = gateway_pb2_grpc.GenerationStub(small_window).GenerateStream(
            stalled_request("stalled"), timeout=60)
        await wait_until(lambda: ("stalled", True) in h.fake.pauses)
        num_sent_at_pause = h.fake.num_tokens_sent["stalled"]
        normal = await collect(h.generation.GenerateStream(request(max_tokens=40), timeout=30))
        await asyncio.sleep(0.2)  # time the scheduler would have used to run ahead
        num_sent_paused = h.fake.num_tokens_sent["stalled"]
        responses = await read_rest(stalled)
        await small_window.close()
        expected = [h.fake.reply_ids[i % len(h.fake.reply_ids)] for i in range(NUM_TOKENS)]
        return normal, num_sent_at_pause, num_sent_paused, responses, list(h.fake.pauses), expected

    normal, at_pause, paused, responses, pauses, expected = run(
        model_dir, body, max_model_len=100_000, limits=RequestLimitsConfig(max_unread_stream_tokens=MAX_UNREAD,
                                                    stalled_stream_timeout_s=30.0))
    assert normal[-1].usage.completion_tokens == 40
    assert all(request_id == "stalled" for request_id, _ in pauses)  # the reader never paused
    assert pauses[0] == ("stalled", True) and pauses[-1] == ("stalled", False)
    assert [p for _, p in pauses] == [True, False] * (len(pauses) // 2)
    assert paused == at_pause and paused < NUM_TOKENS // 4
    assert [t for r in responses for t in r.token_ids] == expected
    assert responses[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
