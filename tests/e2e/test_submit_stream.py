"""SchedulerService.SubmitStream against the real scheduler (tiny model, loopback): many requests
over one call, each step's events in one message, requests ending and failing in-band."""

import queue
import time

import grpc
import pytest
from google.rpc import error_details_pb2, status_pb2
from pagedserve.services.rpc.internal.v1 import common_pb2, scheduler_pb2
from pagedserve.services.rpc.v1 import common_pb2 as public_common_pb2
from pagedserve.services.rpc.v1 import gateway_pb2

from tests.e2e.stack import assert_idle
from tests.e2e.submit_call import SubmitCall

PROMPT = [1, 57, 300, 12, 99, 401, 7]


def submit_request(request_id: str, max_tokens: int, **sampling) -> scheduler_pb2.SubmitRequest:
    return scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=PROMPT,
        sampling=common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                           **{"temperature": 0.0, **sampling}))


def submit(request_id: str, max_tokens: int, **sampling) -> scheduler_pb2.SubmitStreamRequest:
    return scheduler_pb2.SubmitStreamRequest(
        submit=submit_request(request_id, max_tokens, **sampling))


def open_call(scheduler):
    outbox: queue.Queue = queue.Queue()
    return outbox, scheduler.SubmitStream(iter(outbox.get, None), timeout=60)


def test_requests_share_the_call_and_match_a_call_each(stack, scheduler):
    outbox, responses = open_call(scheduler)
    outbox.put(submit("mux-a", 8))
    outbox.put(submit("mux-b", 12))
    tokens: dict[str, list[int]] = {"mux-a": [], "mux-b": []}
    done, num_shared = set(), 0
    for response in responses:
        num_shared += len(response.events) == 2
        for event in response.events:
            assert not event.error_status
            for delta in event.response.outputs:
                tokens[event.request_id] += delta.token_ids
            if event.done:
                done.add(event.request_id)
        if done == set(tokens):
            outbox.put(None)
    assert done == {"mux-a", "mux-b"}
    assert num_shared > 0, "the two requests never shared a message"
    for request_id, num_tokens in (("mux-a", 8), ("mux-b", 12)):
        alone = [t for r in SubmitCall(scheduler, submit_request(f"{request_id}-alone",
                                                                 num_tokens), timeout=60)
                 for o in r.outputs for t in o.token_ids]
        assert tokens[request_id] == alone
    assert_idle(stack)


def test_a_bad_request_fails_in_band_and_the_call_goes_on(stack, scheduler):
    outbox, responses = open_call(scheduler)
    outbox.put(submit("mux-bad", 4, temperature=-1.0))
    outbox.put(submit("mux-good", 4))
    ends = {}
    for response in responses:
        for event in response.events:
            if event.error_status or event.done:
                ends[event.request_id] = event
        if len(ends) == 2:
            outbox.put(None)
    assert ends["mux-good"].done and not ends["mux-good"].error_status
    status = status_pb2.Status.FromString(ends["mux-bad"].error_status)
    assert status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "temperature" in status.message
    bad_request = error_details_pb2.BadRequest()
    assert any(d.Unpack(bad_request) for d in status.details
               if d.Is(error_details_pb2.BadRequest.DESCRIPTOR))
    assert [v.field for v in bad_request.field_violations] == ["sampling.temperature"]


def test_cancel_aborts_one_request_and_leaving_the_call_aborts_the_rest(stack, scheduler):
    outbox, responses = open_call(scheduler)
    outbox.put(submit("mux-cancel", 200))
    outbox.put(submit("mux-left", 200))
    is_cancelled, acknowledged = False, []
    after_cancel: dict[str, int] = {"mux-cancel": 0, "mux-left": 0}
    for response in responses:
        for event in response.events:
            assert not event.error_status
            if event.done:
                assert not event.HasField("response")
                acknowledged.append(event.request_id)
                continue
            after_cancel[event.request_id] += is_cancelled
        if not is_cancelled:
            outbox.put(scheduler_pb2.SubmitStreamRequest(cancel_request_id="mux-cancel"))
            is_cancelled = True
        elif after_cancel["mux-left"] >= 5:
            break
    # a step already running may report it once more; after that it is gone
    assert after_cancel["mux-cancel"] <= 2
    assert acknowledged == ["mux-cancel"]
    responses.cancel()
    assert_idle(stack)


def test_a_request_id_live_in_the_call_again_fails_the_call(stack, scheduler):
    outbox, responses = open_call(scheduler)
    outbox.put(submit("mux-twice", 200))
    outbox.put(submit("mux-twice", 200))
    with pytest.raises(grpc.RpcError) as failure:
        for _ in responses:
            pass
    assert failure.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "mux-twice" in failure.value.details()
    outbox.put(None)
    assert_idle(stack)


def test_a_cancelled_id_may_come_again_right_behind_its_cancel(stack, scheduler):
    outbox, responses = open_call(scheduler)
    outbox.put(submit("mux-again", 200))
    next(responses)
    outbox.put(scheduler_pb2.SubmitStreamRequest(cancel_request_id="mux-again"))
    outbox.put(submit("mux-again", 3))
    ends = []
    for response in responses:
        for event in response.events:
            assert not event.error_status
            if event.done:
                ends.append(event)
        if len(ends) == 2:
            break
    # first the cancel's answer (no response), then the second request's end
    assert not ends[0].HasField("response")
    assert ends[1].response.outputs[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    outbox.put(None)
    assert_idle(stack)


def test_through_the_gateway_a_cancelled_id_runs_again_with_none_of_the_old_tokens(
        stack, generation):
    def generate(request_id: str, max_tokens: int) -> gateway_pb2.GenerateRequest:
        return gateway_pb2.GenerateRequest(
            request_id=request_id, token_ids=public_common_pb2.TokenIds(token_ids=PROMPT),
            sampling=public_common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                      ignore_eos=True))

    first = generation.GenerateStream(gateway_pb2.GenerateStreamRequest(
        request_id="gw-again", token_ids=public_common_pb2.TokenIds(token_ids=PROMPT),
        sampling=public_common_pb2.SamplingParams(temperature=0.0, max_tokens=200,
                                                  ignore_eos=True)), timeout=60)
    next(first)
    first.cancel()
    for _ in range(200):  # until the scheduler has answered the cancel
        try:
            again = generation.Generate(generate("gw-again", 4), timeout=60)
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, exc
            assert "already in use" in exc.details()
            time.sleep(0.05)
    reference = generation.Generate(generate("gw-reference", 4), timeout=60)
    assert list(again.outputs[0].token_ids) == list(reference.outputs[0].token_ids)
    assert_idle(stack)
