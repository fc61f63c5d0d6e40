"""A short request that arrives while the scheduler service prefills a 7,000-token prompt: the
whole engine loop (AsyncEngine, async scheduling, a simulated worker whose steps the test
finishes one at a time) plans it in the first step planned after its arrival, that step is
short, and its first token comes with the second step to end after it arrived."""

from __future__ import annotations

import asyncio
import json
import threading

from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.services.common.engine_api import SubmitRequest
from pagedserve.services.common.sampling_params import SamplingParams

from pagedserve.llm_engine import LLMEngine

LONG_PROMPT = [3 + i % 200 for i in range(7000)]
SHORT_PROMPT = [7, 8, 9, 10, 11, 12, 13, 14]
ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)


class SteppedWorker:
    """A worker whose step n ends only once the test has let n steps end."""

    def __init__(self, worker) -> None:
        self.worker = worker
        self.plans = []  # every plan sent, in order
        self.num_released = 0
        self.waited_on: list[int] = []  # step ids whose result the engine has waited for
        self._cond = threading.Condition()

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def submit_step(self, plan):
        self.plans.append(plan)
        return _SteppedFuture(self, plan)

    def release(self, num_steps: int) -> None:
        with self._cond:
            self.num_released += num_steps
            self._cond.notify_all()

    def wait_until_waited_on(self, step_id: int) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: step_id in self.waited_on, timeout=30)

    def first_step_with(self, prompt: list[int]) -> int:
        return next(p.step_id for p in self.plans
                    for seq in p.new_seqs if list(seq.token_ids) == prompt)


class _SteppedFuture:
    """Runs the step on the wrapped worker when the engine first waits for it: the engine waits
    in step order, so the worker still gets the steps in order."""

    def __init__(self, owner: SteppedWorker, plan) -> None:
        self.owner = owner
        self.plan = plan
        self.output = None

    def result(self, timeout: float | None = None):
        owner = self.owner
        with owner._cond:
            if self.plan.step_id not in owner.waited_on:
                owner.waited_on.append(self.plan.step_id)
                owner._cond.notify_all()
            assert owner._cond.wait_for(lambda: owner.num_released >= self.plan.step_id, 30)
        if self.output is None:
            self.output = owner.worker.submit_step(self.plan).result()
        return self.output


def sim_engine(tmp_path, tiny_model_dir) -> LLMEngine:
    """Free simulated steps; a model folder whose length limit holds a 7,000-token prompt."""
    config = json.loads((tiny_model_dir("llama") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 8192}))
    return LLMEngine.from_kwargs(
        model=str(tmp_path), device="sim", sim_model="Llama-3-8B", sim_time_scale=0.0,
        block_size=16, num_gpu_blocks_override=1024, num_cpu_blocks_override=0,
        max_num_batched_tokens=2048)


def test_a_short_request_arriving_mid_prefill_is_in_the_next_step_planned(tmp_path,
                                                                           tiny_model_dir):
    engine = sim_engine(tmp_path, tiny_model_dir)
    worker = SteppedWorker(engine.core.workers[0])
    engine.core.workers = [worker]
    first = engine.core.scheduler._step_id + 1

    async def run() -> tuple[int, int]:
        engine_loop = await AsyncEngine.start(lambda: engine.core, stop_timeout_s=5.0)
        try:
            long_sink, short_sink = asyncio.Queue(), asyncio.Queue()
            await engine_loop.submit(SubmitRequest("long", LONG_PROMPT, ONE_TOKEN), long_sink)
            assert await asyncio.to_thread(worker.wait_until_waited_on, first)
            num_planned = len(worker.plans)  # step `first` runs, the one behind it is sent
            submitted = asyncio.create_task(
                engine_loop.submit(SubmitRequest("short", SHORT_PROMPT, ONE_TOKEN), short_sink))
            await asyncio.sleep(0)  # the request is queued for the engine
            worker.release(first + 100)
            await submitted
            report = await short_sink.get()
            assert report.outputs[0].token_ids
            while not (await long_sink.get()).finished:
                pass
            return num_planned, worker.first_step_with(SHORT_PROMPT)
        finally:
            await engine_loop.stop()

    num_planned, short_step = asyncio.run(run())
    assert num_planned == 2 and worker.first_step_with(LONG_PROMPT) == first
    assert short_step == first + 2  # step `first` ran at its arrival; `first + 1` was sent
    threshold = engine.core.scheduler.long_prefill_token_threshold
    short_plan, = [p for p in worker.plans if p.step_id == short_step]
    assert short_plan.num_scheduled_tokens == threshold + len(SHORT_PROMPT)  # a short step
    long_seq_id = worker.plans[0].new_seqs[0].seq_id
    chunks = [s.num_scheduled_tokens for p in worker.plans for s in [*p.new_seqs, *p.running_seqs]
              if s.seq_id == long_seq_id]
    assert sum(chunks[:5]) == 7000  # one step more than alone: it tops up everywhere else
