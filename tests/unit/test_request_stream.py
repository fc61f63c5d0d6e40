"""A Submit stream behind its engine: the reports queued since its last event go as one."""

from __future__ import annotations

import asyncio

import pytest
from pagedserve.scheduler_svc.async_engine import RequestStream
from pagedserve.scheduler_svc.outputs import merge_request_outputs
from pagedserve.services.common.outputs import CompletionOutput, FinishReason, RequestOutput
from pagedserve.services.common.step_plan import TokenLogprob


def _report(index_tokens: dict[int, list[int]], finished: bool = False,
            reason: FinishReason | None = None, cached: int = 0,
            prompt_logprobs=None) -> RequestOutput:
    outputs = [CompletionOutput(index=i, token_ids=list(tokens), logprobs=[-1.0] * len(tokens),
                                top_logprobs=[[TokenLogprob(t, -1.0)] for t in tokens],
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


def test_a_stream_behind_sends_one_event_for_what_queued_and_keeps_an_error_for_later():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        abandoned: list[str] = []
        stream = RequestStream("r", queue, abandoned.append)
        for token in (1, 2, 3):
            queue.put_nowait(_report({0: [token]}))
        first = await anext(stream)
        queue.put_nowait(_report({0: [4]}))
        queue.put_nowait(RuntimeError("engine step failed"))
        queue.put_nowait(_report({0: [5]}))  # never read: the error ends the stream
        second = await anext(stream)
        with pytest.raises(RuntimeError, match="engine step failed"):
            await anext(stream)
        return first, second, abandoned

    first, second, abandoned = asyncio.run(main())
    assert first.outputs[0].token_ids == [1, 2, 3] and second.outputs[0].token_ids == [4]
    assert abandoned == []


def test_a_finished_report_ends_the_merge_and_the_stream():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        stream = RequestStream("r", queue, lambda request_id: None)
        queue.put_nowait(_report({0: [1]}))
        queue.put_nowait(_report({0: [2]}, finished=True, reason=FinishReason.STOP))
        return [report async for report in stream]

    (only,) = asyncio.run(main())
    assert only.finished and only.outputs[0].token_ids == [1, 2]
    assert only.outputs[0].finish_reason == FinishReason.STOP
