"""Backpressure through the scheduler's engine loop on a real (tiny) model: a paused request takes
no steps while another completes, the loop idles when every request is paused, and after resume
the request's seeded tokens are those of a run that never paused."""

from __future__ import annotations

import asyncio

import pytest
from pagedserve.scheduler_svc.async_engine import EngineService
from pagedserve.services.common.engine_api import PauseRequest, SubmitRequest
from pagedserve.services.common.errors import NotFound
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


async def tokens_of(stream, at_least: int | None = None) -> list[int]:
    """The stream's tokens to its end, or until it has `at_least`."""
    tokens: list[int] = []
    async for output in stream:
        tokens += output.outputs[0].token_ids if output.outputs else []
        if at_least is not None and len(tokens) >= at_least:
            break
    return tokens


def test_a_paused_request_takes_no_steps_and_resumes_with_the_same_tokens(llama_dir):
    async def run() -> None:
        core = make_engine(llama_dir).core
        counter = StepCounter(core)
        service = await EngineService.start(lambda: core, 10.0)
        try:
            alone = await tokens_of(await service.submit(SubmitRequest("alone", PROMPT, SEEDED)))
            slow = await service.submit(SubmitRequest("slow", PROMPT, SEEDED, owner="o"))
            before = await tokens_of(slow, at_least=4)
            with pytest.raises(NotFound):
                await service.set_paused(PauseRequest("slow", owner="someone else"))
            await service.set_paused(PauseRequest("slow", owner="o"))
            assert service.get_load().num_paused == 1
            other = await tokens_of(await service.submit(SubmitRequest("other", PROMPT, GREEDY)))
            assert len(other) == 16
            group, = core.scheduler.running
            # at most the steps under way when the pause came (asynchronous scheduling keeps
            # two in flight between engine steps, and one more was being processed), and what
            # the stream held, not the 16 the other request took
            assert group.request_id == "slow" and group.is_paused
            assert group.seqs[0].num_output_tokens <= len(before) + 4
            num_calls = counter.num_calls
            await asyncio.sleep(0.3)
            assert counter.num_calls <= num_calls + 1  # idle, not spinning on paused work

            await service.set_paused(PauseRequest("slow", owner="o", is_paused=False))
            after = await tokens_of(slow)
            assert before + after == alone
            assert service.get_load().num_paused == 0
            assert core.block_manager.num_free_gpu_blocks == core.block_manager.num_gpu_blocks
        finally:
            await service.stop()

    asyncio.run(run())


def test_a_paused_request_is_still_aborted_by_its_caller_leaving(llama_dir):
    async def run() -> None:
        core = make_engine(llama_dir).core
        service = await EngineService.start(lambda: core, 10.0)
        try:
            stream = await service.submit(SubmitRequest("gone", PROMPT, SEEDED))
            await tokens_of(stream, at_least=2)
            await service.set_paused(PauseRequest("gone"))
            stream.close()
            await tokens_of(await service.submit(SubmitRequest("next", PROMPT, GREEDY)))
            assert not core.has_unfinished_requests() and core.scheduler.num_paused == 0
            assert core.block_manager.num_free_gpu_blocks == core.block_manager.num_gpu_blocks
            with pytest.raises(NotFound):
                await service.set_paused(PauseRequest("gone", is_paused=False))
        finally:
            await service.stop()

    asyncio.run(run())
