"""scheduler.proto converters: every field survives the wire."""

import dataclasses

import pytest
from pagedserve.services.common.engine_api import (
    AbortRequest,
    EngineLoad,
    PauseRequest,
    ResumedOutput,
    SubmitRequest,
)
from pagedserve.services.common.errors import InvalidRequest
from pagedserve.services.common.outputs import RequestOutput, SequenceDelta
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import TokenIdLogprob
from pagedserve.services.rpc.convert_scheduler import (
    abort_request_from_proto,
    abort_request_to_proto,
    load_from_proto,
    load_to_proto,
    pause_request_from_proto,
    pause_request_to_proto,
    sequence_delta_from_proto,
    sequence_delta_to_proto,
    submit_request_from_proto,
    submit_request_to_proto,
    token_event_from_proto,
    token_event_to_proto,
    watch_load_request_from_proto,
    watch_load_request_to_proto,
)
from pagedserve.services.rpc.internal.v1 import common_pb2, scheduler_pb2


def _wire(msg):
    return type(msg).FromString(msg.SerializeToString())


TOP = [[TokenIdLogprob(5, -0.25), TokenIdLogprob(9, -1.5)], [TokenIdLogprob(3, -0.125)]]


def test_every_proto_field_is_converted():
    # the trace context is the transport's (services/rpc/request_span), not the engine's
    assert set(scheduler_pb2.SubmitRequest.DESCRIPTOR.fields_by_name) - {"trace_context"} == {
        f.name for f in dataclasses.fields(SubmitRequest)}
    assert set(scheduler_pb2.SequenceDelta.DESCRIPTOR.fields_by_name) == {
        f.name for f in dataclasses.fields(SequenceDelta)}
    assert (len(scheduler_pb2.GetLoadResponse.DESCRIPTOR.fields)
            == len(dataclasses.fields(EngineLoad)))


def test_both_load_responses_carry_the_same_fields():
    def fields(message_type):
        return [(f.name, f.number, f.type) for f in message_type.DESCRIPTOR.fields]
    assert fields(scheduler_pb2.GetLoadResponse) == fields(scheduler_pb2.WatchLoadResponse)


def test_submit_request_round_trip():
    request = SubmitRequest(
        request_id="req-1", prompt_token_ids=[1, 49151, 0, 7],
        sampling=SamplingParams(n=2, temperature=0.7, seed=3, logprobs=4, stop=("x",)),
        priority=-3, owner="3f9a")
    assert submit_request_from_proto(_wire(submit_request_to_proto(request))) == request


def test_embedding_request_and_its_vector_round_trip():
    request = SubmitRequest(request_id="e", prompt_token_ids=[4, 5], sampling=SamplingParams(),
                            is_pooling=True)
    assert submit_request_from_proto(_wire(submit_request_to_proto(request))) == request
    output = RequestOutput(request_id="e", outputs=[SequenceDelta(index=0, token_ids=[],
                                                                  finish_reason="stop")],
                           finished=True, num_prompt_tokens=2, num_cached_tokens=0,
                           embedding=[0.5, -0.75, 0.125])
    assert token_event_from_proto(_wire(token_event_to_proto(output)), "e") == output


def test_submit_request_with_resumed_outputs_round_trip():
    request = SubmitRequest(
        request_id="req-2", prompt_token_ids=[1, 2], sampling=SamplingParams(n=3, seed=7),
        resumed_outputs=[ResumedOutput(0, [5, 6]), ResumedOutput(2, [49151])])
    assert submit_request_from_proto(_wire(submit_request_to_proto(request))) == request


def test_an_output_resumed_twice_is_refused():
    msg = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1], resumed_outputs=[
        scheduler_pb2.ResumedOutput(index=1, token_ids=[3]),
        scheduler_pb2.ResumedOutput(index=1, token_ids=[4])])
    with pytest.raises(InvalidRequest, match=r"resumed_outputs .*\[1, 1\]"):
        submit_request_from_proto(msg)


@pytest.mark.parametrize(("interval_s", "expected_s"), [(0.25, 0.25), (0.0, 0.1), (0.001, 0.01)])
def test_watch_load_request_round_trip(interval_s, expected_s):
    msg = _wire(watch_load_request_to_proto(interval_s))
    assert watch_load_request_from_proto(msg) == pytest.approx(expected_s)


def test_submit_request_with_bad_sampling_names_the_field():
    msg = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1],
                                      sampling=common_pb2.SamplingParams(top_p=0.0))
    with pytest.raises(InvalidRequest, match="top_p"):
        submit_request_from_proto(msg)


def test_a_client_set_arrival_time_is_no_longer_read():
    """Field 5 is reserved: an old client's arrival_time_s is skipped, never a queue key."""
    msg = scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1])
    assert "arrival_time_s" not in scheduler_pb2.SubmitRequest.DESCRIPTOR.fields_by_name
    old_wire = msg.SerializeToString() + bytes([0x29]) + b"\x00" * 8  # field 5, fixed64
    assert submit_request_from_proto(
        scheduler_pb2.SubmitRequest.FromString(old_wire)).request_id == "r"


@pytest.mark.parametrize("output", [
    SequenceDelta(index=1, token_ids=[4, 5], logprobs=[-0.5, -2.0], top_logprobs=TOP,
                  cumulative_logprob=-2.5, finish_reason="length"),
    SequenceDelta(index=0, token_ids=[], finish_reason="error", error="worker died"),
    SequenceDelta(index=3, token_ids=[7]),
], ids=["finished", "error", "running"])
def test_sequence_delta_round_trip(output):
    assert sequence_delta_from_proto(_wire(sequence_delta_to_proto(output))) == output


def test_token_event_round_trip_keeps_prefix_cache_holes():
    output = RequestOutput(
        request_id="req-2",
        outputs=[SequenceDelta(index=0, token_ids=[8], logprobs=[-0.5], finish_reason="stop",
                               cumulative_logprob=-0.5),
                 SequenceDelta(index=1, token_ids=[9], logprobs=[-0.75], finish_reason="abort",
                               cumulative_logprob=-0.75)],
        finished=True, num_prompt_tokens=40, num_cached_tokens=32,
        prompt_logprobs=[None, None, [TokenIdLogprob(3, -1.0), TokenIdLogprob(4, -0.5)]])
    msg = _wire(token_event_to_proto(output))
    assert token_event_from_proto(msg, "req-2", has_prompt_logprobs=True) == output


def test_token_event_without_prompt_logprobs_or_finish():
    output = RequestOutput(request_id="r", outputs=[SequenceDelta(index=0, token_ids=[1, 2])],
                           finished=False, num_prompt_tokens=3, num_cached_tokens=0)
    assert token_event_from_proto(_wire(token_event_to_proto(output)), "r") == output


@pytest.mark.parametrize("abort", [
    AbortRequest("req-9"), AbortRequest("req-9", owner="ab12"),
    AbortRequest("req-9", owner="ab12", is_admin=True)])
def test_abort_request_round_trip(abort):
    assert abort_request_from_proto(_wire(abort_request_to_proto(abort))) == abort


def test_every_abort_field_is_converted():
    assert set(scheduler_pb2.AbortRequest.DESCRIPTOR.fields_by_name) == {
        f.name for f in dataclasses.fields(AbortRequest)}


@pytest.mark.parametrize("message_type", [scheduler_pb2.GetLoadResponse,
                                          scheduler_pb2.WatchLoadResponse])
def test_load_round_trip(message_type):
    load = EngineLoad(num_running=3, num_waiting=2, num_swapped=1, num_gpu_blocks_used=17,
                      num_gpu_blocks=512, num_cpu_blocks_used=4, num_cpu_blocks=256,
                      prefix_cache_hit_rate=0.375, num_preemptions=2**40,
                      num_worker_rebuilds=3, num_paused=5)
    assert load_from_proto(_wire(load_to_proto(load, message_type))) == load


@pytest.mark.parametrize("request_", [
    PauseRequest("req-9", owner="ab12"), PauseRequest("req-9", owner="ab12", is_paused=False)])
def test_pause_request_round_trip_is_pause_or_resume(request_):
    msg = pause_request_to_proto(request_)
    assert isinstance(msg, scheduler_pb2.PauseRequest if request_.is_paused
                      else scheduler_pb2.ResumeRequest)
    assert pause_request_from_proto(_wire(msg)) == request_
    assert set(type(msg).DESCRIPTOR.fields_by_name) == {"request_id", "owner"}
