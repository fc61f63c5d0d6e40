"""Stopping the scheduler service while its engine thread is inside a worker call: the workers'
channels close only after that call returns (a gRPC channel closed under a call in flight on
another thread can crash the process), and the wait is bounded."""

from __future__ import annotations

import asyncio
import threading
import time

from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.scheduler_svc.servicer import create_scheduler_server, stop_scheduler
from pagedserve.services.common.config import SchedulerServiceConfig
from pagedserve.services.common.engine_api import SubmitRequest
from pagedserve.services.common.sampling_params import SamplingParams

from tests.integration.test_engine import make_engine


class GatedWorker:
    """A real worker whose steps wait at a gate; records whether close() came during a step."""

    def __init__(self, worker, step_s: float) -> None:
        self.worker = worker
        self.step_s = step_s
        self.in_step = threading.Event()
        self.release = threading.Event()
        self.is_stepping = False
        self.closes: list[bool] = []  # per close(): was a step running

    def __getattr__(self, name):
        return getattr(self.worker, name)

    def submit_step(self, plan):
        self.is_stepping = True
        self.in_step.set()
        self.release.wait(self.step_s)
        try:
            return self.worker.submit_step(plan)
        finally:
            self.is_stepping = False

    def close(self) -> None:
        self.closes.append(self.is_stepping)


def stop_mid_step(model_dir, step_s: float, stop_timeout_s: float) -> tuple[GatedWorker, float]:
    """Start the service, submit a request, stop while its step waits at the gate; returns the
    worker and how long stop_scheduler took."""
    engine = make_engine(model_dir)
    worker = GatedWorker(engine.core.workers[0], step_s)
    engine.core.workers = [worker]

    async def run() -> float:
        server, servicer = create_scheduler_server(engine.config,
                                                   SchedulerServiceConfig(port=0))
        await server.start()
        servicer.engine = await AsyncEngine.start(lambda: engine.core, stop_timeout_s)
        await servicer.engine.submit(SubmitRequest("r", [5, 6, 7], SamplingParams(max_tokens=4)),
                                     asyncio.Queue())
        assert await asyncio.to_thread(worker.in_step.wait, 30)
        start = time.monotonic()
        await stop_scheduler(server, servicer)
        return time.monotonic() - start

    try:
        return worker, asyncio.run(run())
    finally:
        worker.release.set()


def test_workers_close_after_the_engine_threads_call_returns(llama_dir):
    worker, _ = stop_mid_step(llama_dir, step_s=1.0, stop_timeout_s=60.0)
    assert worker.closes == [False]


def test_a_stuck_engine_thread_delays_the_stop_only_by_the_timeout(llama_dir):
    worker, stop_s = stop_mid_step(llama_dir, step_s=60.0, stop_timeout_s=0.2)
    assert worker.closes == []  # still in its call: the channels are left to the process exit
    assert stop_s < 30.0
