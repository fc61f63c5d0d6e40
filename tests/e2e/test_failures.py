"""A worker that dies mid-generation: the requests of the failed step end with an error status
that says what failed, every block is freed, and the scheduler and gateway keep answering."""

import grpc
import pytest

from pagedserve.v1 import (
    common_pb2,
    gateway_pb2,
    gateway_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
)
from tests.e2e.stack import assert_idle, start_stack, tiny_config


def test_a_failed_step_ends_its_requests_with_internal_and_the_service_keeps_serving(
        tiny_served_model_dir):
    stack = start_stack(tiny_config(tiny_served_model_dir), step_timeout_s=5.0)
    try:
        with grpc.insecure_channel(stack.gateway_address) as channel:
            stub = gateway_pb2_grpc.GenerationStub(channel)
            call = stub.GenerateStream(gateway_pb2.GenerateRequest(
                token_ids=gateway_pb2.TokenIds(token_ids=[1, 2, 3]),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=480,
                                                   ignore_eos=True)), timeout=60)
            next(call)
            stack.loop.run(stack.worker[0].server.stop(0))  # the worker is gone
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert "engine step" in info.value.details()
            assert "unavailable" in info.value.details().lower()
        assert_idle(stack)
        # the scheduler still answers: a new request fails alone, with the reason
        with grpc.insecure_channel(stack.scheduler_address) as channel:
            scheduler = scheduler_pb2_grpc.SchedulerStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(scheduler.Submit(scheduler_pb2.SubmitRequest(
                    request_id="after", prompt_token_ids=[1, 2],
                    sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=30))
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert scheduler.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5).num_gpu_blocks > 0
    finally:
        stack.close()
