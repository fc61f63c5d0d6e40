"""Backpressure through the three services (one process, real gRPC, tiny model): a client that
stops reading has its request paused in the scheduler (it takes no engine steps while a normal
client's request completes), then resumed when it reads again, with the seeded tokens of a run
that never paused; a client that never comes back is still aborted after the stall timeout.
An HTTP stream whose client reads nothing is paused too, once the small send buffer under it is
full, not after everything the kernel would buffer."""

import dataclasses
import json
import socket

import grpc
import pytest
from pagedserve.services.common.config import CacheConfig
from pagedserve.services.gateway.config import ConnectionLimitsConfig, RequestLimitsConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle, start_stack, tiny_config
from tests.e2e.test_metrics import scrape, value, wait_until

MAX_UNREAD = 8
PROMPT = [5, 9, 17, 33, 65, 129]
# a receive window of ~1 KB: the first responses fill it, the rest wait in the gateway
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


def seeded(max_tokens: int) -> gateway_pb2.GenerateStreamRequest:
    return gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=PROMPT),
        sampling=common_pb2.SamplingParams(temperature=1.0, seed=11, max_tokens=max_tokens,
                                           logprobs=5, ignore_eos=True))


def greedy(max_tokens: int) -> gateway_pb2.GenerateStreamRequest:
    return gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=PROMPT[::-1]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True))


def token_ids(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def serve(model_dir, stalled_stream_timeout_s: float, **gateway_kw):
    config = tiny_config(model_dir)
    config = dataclasses.replace(config, cache=CacheConfig(
        kv_cache_memory_gib=0.01, swap_space_gib=0.01, num_gpu_blocks_override=64))
    return start_stack(config, metrics_port=0, limits=RequestLimitsConfig(
        max_unread_stream_tokens=MAX_UNREAD, stalled_stream_timeout_s=stalled_stream_timeout_s),
        **gateway_kw)


def num_generated(stack) -> float:
    return value(scrape(stack, "scheduler"), "vllm:generation_tokens_total")


def test_an_unread_stream_takes_no_steps_and_resumes_with_the_same_tokens(
        tiny_served_model_dir):
    stack = serve(tiny_served_model_dir, stalled_stream_timeout_s=120.0)
    try:
        with grpc.insecure_channel(stack.gateway_address) as channel, \
                grpc.insecure_channel(stack.gateway_address, options=SMALL_WINDOW) as small:
            generation = gateway_pb2_grpc.GenerationServiceStub(channel)
            unpaused = token_ids(generation.GenerateStream(seeded(100), timeout=60))
            assert len(unpaused) == 100
            stalled = gateway_pb2_grpc.GenerationServiceStub(small).GenerateStream(
                seeded(100), timeout=120)
            wait_until(lambda: stack.load().num_paused_requests == 1, timeout_s=30)
            assert value(scrape(stack, "scheduler"), "pagedserve:num_requests_paused") == 1
            before = num_generated(stack)
            normal = token_ids(generation.GenerateStream(greedy(40), timeout=60))
            # the normal request's 40, plus at most the steps in flight when the pause came
            assert len(normal) == 40 and num_generated(stack) - before <= 40 + 2
            assert stack.load().num_paused_requests == 1
            assert token_ids(stalled) == unpaused
        assert_idle(stack)
        assert stack.load().num_paused_requests == 0
    finally:
        stack.close()


def test_a_paused_stream_that_is_never_read_is_still_aborted(tiny_served_model_dir):
    stack = serve(tiny_served_model_dir, stalled_stream_timeout_s=5.0)
    try:
        with grpc.insecure_channel(stack.gateway_address, options=SMALL_WINDOW) as small:
            stalled = gateway_pb2_grpc.GenerationServiceStub(small).GenerateStream(
                seeded(100), timeout=120)
            wait_until(lambda: stack.load().num_paused_requests == 1, timeout_s=30)
            assert_idle(stack, timeout_s=30)  # aborted after the timeout: every block free
            with pytest.raises(grpc.RpcError) as err:
                token_ids(stalled)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "stalled_stream_timeout_s=5" in err.value.details()
        assert stack.load().num_paused_requests == 0
    finally:
        stack.close()


def test_an_http_stream_never_read_is_paused_before_it_ends_then_aborted(tiny_served_model_dir):
    """300 tokens of ~250-byte events: the old door wrote them all into kernel buffers and the
    request ran to its end unpaused; now writes stop within ~4 KiB × 2 plus the client's own
    small receive buffer, and the request is paused long before its end."""
    stack = serve(tiny_served_model_dir, stalled_stream_timeout_s=5.0,
                  connections=ConnectionLimitsConfig(http_stream_send_buffer_bytes=4096))
    body = json.dumps({"prompt": PROMPT, "max_tokens": 300, "ignore_eos": True,
                       "temperature": 0, "stream": True}).encode()
    try:
        with socket.socket() as client:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            client.connect(("127.0.0.1", stack.gateway.http_port))
            client.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: "
                           b"application/json\r\ncontent-length: %d\r\n\r\n%s"
                           % (len(body), body))
            wait_until(lambda: stack.load().num_paused_requests == 1
                       or num_generated(stack) >= 300, timeout_s=120)
            assert stack.load().num_paused_requests == 1
            assert num_generated(stack) < 300
            assert_idle(stack, timeout_s=30)  # aborted after the stall timeout
        assert stack.load().num_paused_requests == 0
    finally:
        stack.close()
