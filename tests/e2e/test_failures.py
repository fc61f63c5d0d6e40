"""A worker that dies mid-generation. One that restarts is rebuilt by the scheduler and every
request resumes, by recomputation, with the output it would have had. One that stays gone fails
the requests with an error status that says what failed, every block is freed, and the scheduler
and gateway keep answering."""

import dataclasses
import json

import grpc
import pytest
from pagedserve.services.common.config import SchedulerConfig, WorkerServiceConfig
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.internal.v1 import common_pb2 as internal_common_pb2
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pagedserve.worker_svc.servicer import start_worker

from pagedserve.llm_engine import LLMEngine
from tests.e2e.stack import assert_idle, start_stack, tiny_config
from tests.e2e.submit_call import SubmitCall
from tests.integration.test_engine import all_outputs

# long enough that the requests are still running when the worker dies
GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [4, 5]]
# random weights echo little: single tokens match, every lookup is verified
SPECULATIVE = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
               "adaptive": False}


def _stream(stub, token_ids, sampling=GREEDY):
    return stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=token_ids), sampling=sampling), timeout=120)


def _tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_a_restarted_worker_is_rebuilt_and_every_stream_completes_unchanged(
        tiny_served_model_dir, speculative):
    """With speculation, as the run without it: greedy outputs do not depend on speculation,
    nor on the drafts lost with the worker."""
    config = tiny_config(tiny_served_model_dir)
    if speculative:
        off = LLMEngine.from_kwargs(model=str(tiny_served_model_dir), device="cpu",
                                    num_threads=1)
        expected = [out[0] for out in all_outputs(off, PROMPTS, SamplingParams(
            temperature=0.0, max_tokens=GREEDY.max_tokens, ignore_eos=True)).values()]
        config = dataclasses.replace(config, scheduler=SchedulerConfig(
            speculative_config=json.dumps(SPECULATIVE)))
    stack = start_stack(config)
    try:
        with grpc.insecure_channel(stack.gateway_address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            if not speculative:
                expected = [_tokens(_stream(stub, ids)) for ids in PROMPTS]
            calls = [_stream(stub, ids) for ids in PROMPTS]
            firsts = [next(call) for call in calls]  # every request is running
            server, servicer = stack.worker
            stack.loop.run(server.shutdown(0))  # the worker process dies ...
            servicer.close()
            stack.worker = stack.loop.run(start_worker(  # ... and comes back on its address
                config, WorkerServiceConfig(port=server.port)))
            outputs = [_tokens([first, *call]) for first, call in zip(firsts, calls, strict=True)]
        assert outputs == expected
        assert assert_idle(stack).num_worker_rebuilds == 1
        if speculative:
            assert stack.scheduler[1].engine.core.scheduler.speculator.totals.num_drafts > 0
    finally:
        stack.close()


def test_a_worker_that_stays_gone_fails_its_requests_with_internal_and_the_service_keeps_serving(
        tiny_served_model_dir):
    # the scheduler waits startup_timeout_s for the worker to come back, then gives up
    stack = start_stack(tiny_config(tiny_served_model_dir), step_timeout_s=5.0,
                        startup_timeout_s=2.0)
    try:
        with grpc.insecure_channel(stack.gateway_address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            call = _stream(stub, [1, 2, 3], common_pb2.SamplingParams(
                temperature=0.0, max_tokens=480, ignore_eos=True))
            next(call)
            stack.loop.run(stack.worker[0].servers[0].stop(0))  # the worker is gone
            with pytest.raises(grpc.RpcError) as info:
                list(call)
            assert info.value.code() == grpc.StatusCode.INTERNAL
            details = info.value.details()
            assert "engine step" in details and "not rebuilt" in details
            assert "unavailable" in details.lower()
        assert_idle(stack)
        # the scheduler still answers: a new request fails alone, with the reason
        with grpc.insecure_channel(stack.scheduler_address) as channel:
            scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            with pytest.raises(grpc.RpcError) as info:
                list(SubmitCall(scheduler, scheduler_pb2.SubmitRequest(
                    request_id="after", prompt_token_ids=[1, 2],
                    sampling=internal_common_pb2.SamplingParams(max_tokens=2)), timeout=30))
            assert info.value.code() == grpc.StatusCode.INTERNAL
            assert scheduler.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=5).num_gpu_blocks > 0
    finally:
        stack.close()
