"""A SubmitStream call behind its engine: the reports queued since its last message go as one
event, and an error ends the request in that event."""

from __future__ import annotations

import asyncio

from pagedserve.scheduler_svc.outputs import merge_request_outputs
from pagedserve.scheduler_svc.submit_stream import SubmitStreamCall
from pagedserve.services.common.outputs import FinishReason, RequestOutput, SequenceDelta
from pagedserve.services.common.step_plan import TokenIdLogprob
from pagedserve.services.rpc.internal.v1 import common_pb2, scheduler_pb2


class FakeEngine:
    """Keeps each request's sink: the test plays the engine loop."""

    def __init__(self) -> None:
        self.sinks: dict = {}
        self.dropped: list[str] = []

    async def submit(self, request, sink) -> None:
        self.sinks[request.request_id] = sink

    def drop(self, request_id: str, sink) -> None:
        self.dropped.append(request_id)


def _report(index_tokens: dict[int, list[int]], finished: bool = False,
            reason: FinishReason | None = None, cached: int = 0,
            prompt_logprobs=None) -> RequestOutput:
    outputs = [SequenceDelta(index=i, token_ids=list(tokens), logprobs=[-1.0] * len(tokens),
                             top_logprobs=[[TokenIdLogprob(t, -1.0)] for t in tokens],
                             cumulative_logprob=-float(tokens[-1]) if tokens else 0.0,
                             finish_reason=reason)
               for i, tokens in index_tokens.items()]
    return RequestOutput("r", outputs, finished, num_prompt_tokens=7, num_cached_tokens=cached,
                         prompt_logprobs=prompt_logprobs)


def test_merge_concatenates_per_index_and_keeps_the_latest_state():
    first = _report({0: [1, 2], 1: [5]}, prompt_logprobs=[None])
    merged = merge_request_outputs(first, _report({1: [6, 7], 2: [9]}, cached=4))
    merged = merge_request_outputs(merged, _report({0: [3]}, finished=True,
                                                   reason=FinishReason.LENGTH))
    by_index = {o.index: o for o in merged.outputs}
    assert {i: o.token_ids for i, o in by_index.items()} == {0: [1, 2, 3], 1: [5, 6, 7], 2: [9]}
    assert by_index[1].logprobs == [-1.0] * 3 and len(by_index[0].top_logprobs) == 3
    assert by_index[0].cumulative_logprob == -3.0 and by_index[1].cumulative_logprob == -7.0
    assert by_index[0].finish_reason == FinishReason.LENGTH and by_index[1].finish_reason is None
    assert merged.finished and merged.num_cached_tokens == 0 and merged.prompt_logprobs == [None]


async def _call_with_request() -> tuple[FakeEngine, asyncio.Queue, object, asyncio.Task]:
    """A call with request "r" added; returns the engine, the caller's request queue (None
    half-closes), the call's responses and the task awaiting its first one."""
    engine, requests = FakeEngine(), asyncio.Queue()

    async def incoming():
        while (msg := await requests.get()) is not None:
            yield msg

    responses = SubmitStreamCall(engine, "m").run(incoming())
    first = asyncio.create_task(anext(responses))
    requests.put_nowait(scheduler_pb2.SubmitStreamRequest(
        submit=scheduler_pb2.SubmitRequest(request_id="r", prompt_token_ids=[1, 2])))
    while "r" not in engine.sinks:
        await asyncio.sleep(0)
    return engine, requests, responses, first


def _event(response: scheduler_pb2.SubmitStreamResponse) -> scheduler_pb2.RequestEvent:
    (event,) = response.events
    return event


def test_a_call_behind_sends_one_event_for_what_queued_and_an_error_ends_the_request():
    async def main():
        engine, requests, responses, first = await _call_with_request()
        sink = engine.sinks["r"]
        for token in (1, 2, 3):
            sink.put_nowait(_report({0: [token]}))
        first = _event(await first)
        sink.put_nowait(_report({0: [4]}))
        sink.put_nowait(RuntimeError("engine step failed"))
        sink.put_nowait(_report({0: [5]}))  # never sent: the error ended the request
        second = _event(await anext(responses))
        requests.put_nowait(None)
        rest = [response async for response in responses]
        return first, second, rest, engine.dropped

    first, second, rest, dropped = asyncio.run(main())
    assert list(first.response.outputs[0].token_ids) == [1, 2, 3] and not first.error_status
    assert list(second.response.outputs[0].token_ids) == [4] and second.error_status
    assert not second.done and rest == [] and dropped == []


def test_a_finished_report_ends_the_merge_and_the_request():
    async def main():
        engine, requests, responses, first = await _call_with_request()
        engine.sinks["r"].put_nowait(_report({0: [1]}))
        engine.sinks["r"].put_nowait(_report({0: [2]}, finished=True, reason=FinishReason.STOP))
        only = _event(await first)
        requests.put_nowait(None)
        return only, [response async for response in responses]

    only, rest = asyncio.run(main())
    assert only.done and list(only.response.outputs[0].token_ids) == [1, 2] and rest == []
    assert only.response.outputs[0].finish_reason == common_pb2.FINISH_REASON_STOP


def test_a_full_window_holds_the_steps_until_acknowledged_then_sends_them_merged():
    async def main():
        engine, requests, responses, first = await _call_with_request()
        requests.put_nowait(scheduler_pb2.SubmitStreamRequest(response_window=1))
        await asyncio.sleep(0)
        sink = engine.sinks["r"]
        sink.put_nowait(_report({0: [1]}))
        first = _event(await first)
        waiting = asyncio.create_task(anext(responses))
        for token in (2, 3, 4):  # steps made while the caller handles the first response
            sink.put_nowait(_report({0: [token]}))
            await asyncio.sleep(0)
        held = not waiting.done()
        requests.put_nowait(scheduler_pb2.SubmitStreamRequest(handled_responses=1))
        second = _event(await waiting)
        requests.put_nowait(None)
        return first, held, second

    first, held, second = asyncio.run(main())
    assert list(first.response.outputs[0].token_ids) == [1]
    assert held and list(second.response.outputs[0].token_ids) == [2, 3, 4]
