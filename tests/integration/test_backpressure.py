"""Backpressure through the scheduler's engine loop on a real (tiny) model: a paused request takes
no steps while another completes, the loop idles when every request is paused, and after resume
the request's seeded tokens are those of a run that never paused; a consumer that leaves aborts
only its own request."""

from __future__ import annotations

import asyncio

import pytest
from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.services.common.engine_api import PauseRequest, SubmitRequest
from pagedserve.services.common.errors import NotFound
from pagedserve.services.common.outputs import FinishReason
from pagedserve.services.common.sampling_params import SamplingParams

from tests.integration.test_engine import make_engine

SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
PROMPT = [5, 9, 17, 33, 65, 129]


class StepCounter:
    """Counts the engine loop's calls of EngineCore.step, scheduled work or not."""

    def __init__(self, core) -> None:
        self.num_calls = 0
        step = core.step

        def counted(*args):
            self.num_calls += 1
            return step(*args)

        core.step = counted


async def submit(engine: AsyncEngine, request: SubmitRequest) -> asyncio.Queue:
    """The request's sink, as SubmitStream gives one."""
    sink: asyncio.Queue = asyncio.Queue()
    await engine.submit(request, sink)
    return sink


async def tokens_of(sink: asyncio.Queue, at_least: int | None = None) -> list[int]:
    """The sink's tokens to the request's end, or until it has `at_least` and what was queued
    by then."""
    tokens: list[int] = []
    while True:
        output = await sink.get()
        tokens += output.outputs[0].token_ids if output.outputs else []
        if output.finished or (at_least is not None and len(tokens) >= at_least
                               and sink.empty()):
            return tokens


def test_a_paused_request_takes_no_steps_and_resumes_with_the_same_tokens(llama_dir):
    async def run() -> None:
        core = make_engine(llama_dir).core
        counter = StepCounter(core)
        engine = await AsyncEngine.start(lambda: core, 10.0)
        try:
            alone = await tokens_of(await submit(engine, SubmitRequest("alone", PROMPT, SEEDED)))
            slow = await submit(engine, SubmitRequest("slow", PROMPT, SEEDED, owner="o"))
            before = await tokens_of(slow, at_least=4)
            with pytest.raises(NotFound):
                await engine.set_paused(PauseRequest("slow", owner="someone else"))
            await engine.set_paused(PauseRequest("slow", owner="o"))
            assert engine.get_load().num_paused == 1
            other = await tokens_of(await submit(engine, SubmitRequest("other", PROMPT, GREEDY)))
            assert len(other) == 16
            group, = core.scheduler.running
            # at most the steps under way when the pause came (asynchronous scheduling keeps
            # two in flight between engine steps, and one more was being processed), and what
            # the sink held, not the 16 the other request took
            assert group.request_id == "slow" and group.is_paused
            assert group.seqs[0].num_output_tokens <= len(before) + 4
            num_calls = counter.num_calls
            await asyncio.sleep(0.3)
            assert counter.num_calls <= num_calls + 1  # idle, not spinning on paused work

            await engine.set_paused(PauseRequest("slow", owner="o", is_paused=False))
            after = await tokens_of(slow)
            assert before + after == alone
            assert engine.get_load().num_paused == 0
            assert core.block_manager.num_free_gpu_blocks == core.block_manager.num_gpu_blocks
        finally:
            await engine.stop()

    asyncio.run(run())


def test_a_paused_request_is_still_aborted_by_its_caller_leaving(llama_dir):
    async def run() -> None:
        core = make_engine(llama_dir).core
        engine = await AsyncEngine.start(lambda: core, 10.0)
        try:
            sink = await submit(engine, SubmitRequest("gone", PROMPT, SEEDED))
            await tokens_of(sink, at_least=2)
            await engine.set_paused(PauseRequest("gone"))
            engine.drop("gone", sink)
            await tokens_of(await submit(engine, SubmitRequest("next", PROMPT, GREEDY)))
            assert not core.has_unfinished_requests() and core.scheduler.num_paused == 0
            assert core.block_manager.num_free_gpu_blocks == core.block_manager.num_gpu_blocks
            with pytest.raises(NotFound):
                await engine.set_paused(PauseRequest("gone", is_paused=False))
        finally:
            await engine.stop()

    asyncio.run(run())


def test_a_late_drop_leaves_a_new_request_of_the_same_id_alone(llama_dir):
    async def run() -> tuple[list[int], object]:
        core = make_engine(llama_dir).core
        engine = await AsyncEngine.start(lambda: core, 10.0)
        try:
            first = await submit(engine, SubmitRequest("same", PROMPT, GREEDY))
            await tokens_of(first)
            second = await submit(engine, SubmitRequest("same", PROMPT, GREEDY))
            engine.drop("same", first)  # the first consumer leaves after its request ended
            tokens, last = [], None
            while last is None or not last.finished:
                last = await asyncio.wait_for(second.get(), 60)  # nothing comes if the drop took it
                tokens += last.outputs[0].token_ids
            return tokens, last.outputs[0].finish_reason
        finally:
            await engine.stop()

    tokens, reason = asyncio.run(run())
    assert len(tokens) == 16 and reason == FinishReason.LENGTH
