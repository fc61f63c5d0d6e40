"""bench.gateway_cpu's stand-in scheduler: the SchedulerService a gateway calls, whose engine is a
clock. Every `step_s` each live request gets a token (cycled from `reply_ids`), the last one
finishing it at its max_tokens -- what a real engine reports for a batch of decodes -- and the
scheduler's own SubmitStream call (scheduler_svc.submit_stream) sends them: one message per step
while the gateway keeps up, steps merged while its response window is full. The clock costs a
few µs per token, so the gateway's CPU is what a bench measures.

This module imports neither torch nor the model code: it runs as a light process of its own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from pagedserve.scheduler_svc.submit_stream import serve_submit_stream
from pagedserve.services.common.engine_api import SubmitRequest
from pagedserve.services.common.outputs import FinishReason, RequestOutput, SequenceDelta
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.server import ServiceBinding, create_server


@dataclass(slots=True)
class _Live:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    sink: object  # the call's OutputSink
    num_sent: int = 0


class ClockEngine:
    """What SubmitStreamCall needs of the AsyncEngine: requests in, a token each per step out."""

    def __init__(self, reply_ids: list[int], step_s: float) -> None:
        self._reply_ids = reply_ids
        self._step_s = step_s
        self._live: dict[str, _Live] = {}
        self._has_work = asyncio.Event()
        self._clock: asyncio.Task[None] | None = None

    async def submit(self, request: SubmitRequest, sink) -> None:
        self._live[request.request_id] = _Live(request.request_id, len(request.prompt_token_ids),
                                               request.sampling.max_tokens, sink)
        self._has_work.set()
        if self._clock is None:
            self._clock = asyncio.create_task(self._run())

    def drop(self, request_id: str, sink) -> None:
        live = self._live.get(request_id)
        if live is not None and live.sink is sink:
            del self._live[request_id]

    def finish_sequence(self, request_id: str, index: int) -> None:
        live = self._live.pop(request_id, None)
        if live is not None:
            live.sink.put_nowait(RequestOutput(
                request_id, [SequenceDelta(index, [], finish_reason=FinishReason.STOP)], True,
                live.num_prompt_tokens, 0))

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._live:
                self._has_work.clear()
                await self._has_work.wait()
            start = loop.time()
            self._step()
            await asyncio.sleep(max(0.0, start + self._step_s - loop.time()))

    def _step(self) -> None:
        reply_ids = self._reply_ids
        for live in list(self._live.values()):
            is_last = live.num_sent + 1 >= live.max_tokens
            token = reply_ids[live.num_sent % len(reply_ids)]
            live.num_sent += 1
            live.sink.put_nowait(RequestOutput(
                live.request_id,
                [SequenceDelta(0, [token], finish_reason=FinishReason.LENGTH if is_last else None)],
                is_last, live.num_prompt_tokens, 0))
            if is_last:
                del self._live[live.request_id]


class StepScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, served_model: scheduler_pb2.GetServedModelResponse,
                 reply_ids: list[int], step_s: float) -> None:
        self._served_model = served_model
        self._engine = ClockEngine(reply_ids, step_s)

    async def SubmitStream(self, requests, context):
        async for response in serve_submit_stream(self._engine, self._served_model.model,
                                                  requests):
            yield response

    async def GetServedModel(self, request, context):
        return self._served_model

    async def GetLoad(self, request, context):
        return scheduler_pb2.GetLoadResponse()

    async def WatchLoad(self, request, context):
        yield scheduler_pb2.WatchLoadResponse()
        await asyncio.Event().wait()

    async def WatchKvEvents(self, request, context):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "WatchKvEvents")

    async def Abort(self, request, context):
        await context.abort(grpc.StatusCode.NOT_FOUND, request.request_id)

    async def Pause(self, request, context):
        return scheduler_pb2.PauseResponse()

    async def Resume(self, request, context):
        return scheduler_pb2.ResumeResponse()


def scheduler_process(served_model: bytes, reply_ids: list[int], step_s: float, ports) -> None:
    """A process's body: serves until killed; its port goes to `ports`."""
    logging.basicConfig(level=logging.WARNING)

    async def run() -> None:
        fake = StepScheduler(scheduler_pb2.GetServedModelResponse.FromString(served_model),
                             reply_ids, step_s)
        server, port = create_server([ServiceBinding(
            fake, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
            "pagedserve.internal.v1.SchedulerService")])
        await server.start()
        await server.set_serving(True)
        ports.put(port)
        await asyncio.Event().wait()

    asyncio.run(run())
