"""bench.gateway_cpu's stand-in scheduler: the SchedulerService a gateway calls, whose engine is a
clock. Every `step_s` each SubmitStream call gets one SubmitStreamResponse with one event per
live request of the call, each a token (cycled from `reply_ids`), the last one finishing the
request at its max_tokens with `done` -- the messages a real scheduler sends for a batch of
decodes. It costs a few µs per event, so the gateway's CPU is what a bench measures.

This module imports neither torch nor the engine: it runs as a light process of its own.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import grpc
from pagedserve.services.rpc.internal.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.server import ServiceBinding, create_server


@dataclass(slots=True)
class _Live:
    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    num_sent: int = 0


class StepScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, served_model: scheduler_pb2.GetServedModelResponse,
                 reply_ids: list[int], step_s: float) -> None:
        self._served_model = served_model
        self._reply_ids = reply_ids
        self._step_s = step_s

    async def SubmitStream(self, requests, context):
        live: dict[str, _Live] = {}
        cancelled: list[str] = []
        has_work = asyncio.Event()

        async def read() -> None:
            async for msg in requests:
                if msg.HasField("submit"):
                    submit = msg.submit
                    live[submit.request_id] = _Live(submit.request_id,
                                                    len(submit.prompt_token_ids),
                                                    submit.sampling.max_tokens)
                elif msg.HasField("cancel_request_id"):
                    if live.pop(msg.cancel_request_id, None) is not None:
                        cancelled.append(msg.cancel_request_id)
                elif msg.HasField("finish_sequence"):
                    if live.pop(msg.finish_sequence.request_id, None) is not None:
                        cancelled.append(msg.finish_sequence.request_id)
                has_work.set()

        reader = asyncio.create_task(read())
        loop = asyncio.get_running_loop()
        try:
            while not reader.done():
                if not live and not cancelled:
                    has_work.clear()
                    await has_work.wait()
                start = loop.time()
                await context.write(self._step(live, cancelled))
                await asyncio.sleep(max(0.0, start + self._step_s - loop.time()))
        finally:
            reader.cancel()

    def _step(self, live: dict[str, _Live], cancelled: list[str]
              ) -> scheduler_pb2.SubmitStreamResponse:
        msg = scheduler_pb2.SubmitStreamResponse()
        for request_id in cancelled:
            msg.events.add(request_id=request_id, done=True)
        cancelled.clear()
        reply_ids = self._reply_ids
        for request in list(live.values()):
            event = msg.events.add(request_id=request.request_id)
            response = event.response
            response.num_prompt_tokens = request.num_prompt_tokens
            is_last = request.num_sent + 1 >= request.max_tokens
            response.outputs.add(
                index=0, token_ids=[reply_ids[request.num_sent % len(reply_ids)]],
                finish_reason=(common_pb2.FINISH_REASON_LENGTH if is_last
                               else common_pb2.FINISH_REASON_UNSPECIFIED))
            request.num_sent += 1
            if is_last:
                event.done = True
                del live[request.request_id]
        return msg

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
