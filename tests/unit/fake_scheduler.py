"""A test double of the scheduler service over real grpc.aio (port 0): it serves SubmitStream, as
the gateway calls it, and answers every request with a scripted reply (`tokens_per_event` tokens
per event, the reply cycled up to `num_reply_tokens` if set), for each of the n outputs, then ends
with EOS ("stop") or "length" at max_tokens. With `hang=True` it keeps the request open after the
reply until it is aborted or cancelled, and records which happened. With `limits` set it first
runs the scheduler's own request and admission checks (its live requests are its queue) and
refuses in-band as the scheduler does, details included. Prompt logprobs, when asked, are -1 for
each prompt token and -2, -3, ... for ids 5, 6, .... Pause holds a request's events until Resume;
`pauses` records both in order; `finished` the outputs the gateway finished (a stop string),
in order. `break_after` N fails the call with UNAVAILABLE once a request sent N events."""

from __future__ import annotations

import asyncio

import grpc
from pagedserve.scheduler_svc.request_checks import RequestLimits, check_admission, check_request
from pagedserve.services.common.drain_rate import DrainRate
from pagedserve.services.common.errors import PagedServeError
from pagedserve.services.gateway.validation import ServedModel
from pagedserve.services.rpc.convert_common import sampling_params_from_proto
from pagedserve.services.rpc.convert_scheduler import submit_request_from_proto
from pagedserve.services.rpc.internal.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.server import ServiceBinding, ServiceServer, create_server
from pagedserve.services.rpc.status import rich_status


class FakeScheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, model_dir: str, info: ServedModel, reply_ids: list[int]) -> None:
        self.served_model = scheduler_pb2.GetServedModelResponse(
            model=model_dir, architecture=info.architecture, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, eos_token_ids=info.eos_token_ids,
            block_size=info.block_size, num_gpu_blocks=info.num_gpu_blocks,
            max_num_seqs=info.max_num_seqs)
        self.reply_ids = reply_ids
        self.num_reply_tokens: int | None = None  # cycle reply_ids for this many tokens
        self.tokens_per_event = 1
        self.hang = False
        self.error: str | None = None  # finish every output with "error" and this text
        self.break_after: int | None = None  # fail the call with UNAVAILABLE after N events
        self.submits: list[scheduler_pb2.SubmitRequest] = []
        self.finished: list[tuple[str, int]] = []  # (request_id, index)
        self.cancelled: set[str] = set()
        self.aborted: set[str] = set()
        self.pauses: list[tuple[str, bool]] = []  # (request_id, is_paused)
        self.num_tokens_sent: dict[str, int] = {}
        self.response_window = 0  # as the caller asked
        self.num_responses = 0
        self.num_handled_responses = 0  # as the caller acknowledged
        self._abort_events: dict[str, asyncio.Event] = {}
        self._is_runnable: dict[str, asyncio.Event] = {}  # cleared while paused
        self.any_cancelled = asyncio.Event()
        self.limits: RequestLimits | None = None
        self.drain_rate = DrainRate()

    def _check(self, request) -> None:
        submit = submit_request_from_proto(request)
        check_request(submit.request_id, submit.prompt_token_ids, submit.sampling,
                      submit.priority, self.limits)
        check_admission(submit.prompt_token_ids, submit.sampling, self.limits,
                        len(self._abort_events), self.drain_rate.wait_s)

    async def SubmitStream(self, requests, context):
        events: asyncio.Queue[scheduler_pb2.RequestEvent | None] = asyncio.Queue()
        tasks: dict[str, asyncio.Task] = {}

        async def read():
            async for msg in requests:
                if msg.HasField("submit"):
                    tasks[msg.submit.request_id] = asyncio.create_task(
                        self._serve(msg.submit, events))
                elif msg.HasField("cancel_request_id"):
                    task = tasks.pop(msg.cancel_request_id, None)
                    if task is not None:
                        task.cancel()
                    events.put_nowait(scheduler_pb2.RequestEvent(
                        request_id=msg.cancel_request_id, done=True))
                elif msg.HasField("finish_sequence"):
                    self.finished.append((msg.finish_sequence.request_id,
                                          msg.finish_sequence.index))
                elif msg.HasField("response_window"):
                    self.response_window = msg.response_window
                elif msg.HasField("handled_responses"):
                    self.num_handled_responses += msg.handled_responses

        reader = asyncio.create_task(read())
        try:  # writes, not yields: grpc may drop a generator handler, to be finalized anywhere
            while (event := await events.get()) is not None:
                await context.write(scheduler_pb2.SubmitStreamResponse(events=[event]))
                self.num_responses += 1
            await context.abort(grpc.StatusCode.UNAVAILABLE, "connection reset")
        finally:
            reader.cancel()
            for task in tasks.values():
                task.cancel()

    async def _serve(self, request, events):
        """One request's script; None on `events` breaks the call."""
        request_id = request.request_id

        def send(**fields):
            events.put_nowait(scheduler_pb2.RequestEvent(request_id=request_id, **fields))

        if self.limits is not None:
            try:
                self._check(request)
            except PagedServeError as exc:
                send(error_status=rich_status(exc).SerializeToString())
                return
        self.submits.append(request)
        sampling = sampling_params_from_proto(request.sampling)
        abort = self._abort_events[request_id] = asyncio.Event()
        runnable = self._is_runnable[request_id] = asyncio.Event()
        runnable.set()
        prompt_len = len(request.prompt_token_ids)
        # this call's script is fixed when it starts; a test may change it for later calls
        num_tokens = min(sampling.max_tokens, self.num_reply_tokens or len(self.reply_ids))
        per_event = self.tokens_per_event
        hang = self.hang
        is_complete = False
        try:
            for step in range(0, num_tokens, per_event):
                await runnable.wait()
                if abort.is_set():
                    break
                token_ids = [self.reply_ids[i % len(self.reply_ids)]
                             for i in range(step, min(step + per_event, num_tokens))]
                is_last = step + len(token_ids) == num_tokens and not hang
                finish = common_pb2.FINISH_REASON_UNSPECIFIED
                if is_last:
                    finish = (common_pb2.FINISH_REASON_LENGTH if num_tokens == sampling.max_tokens
                              else common_pb2.FINISH_REASON_STOP)
                if is_last and self.error:
                    finish = common_pb2.FINISH_REASON_ERROR
                event = scheduler_pb2.SubmitResponse(num_prompt_tokens=prompt_len,
                                                     num_cached_tokens=1)
                if step == 0 and sampling.prompt_logprobs is not None:
                    _add_prompt_logprobs(event, list(request.prompt_token_ids),
                                         sampling.prompt_logprobs)
                num_done = step + len(token_ids)
                for index in range(sampling.n):
                    delta = event.outputs.add(index=index, token_ids=token_ids,
                                              finish_reason=finish, cumulative_logprob=-0.5 * num_done,
                                              error=self.error if is_last and self.error else "")
                    if sampling.logprobs is not None:
                        for token_id in token_ids:
                            delta.logprobs.append(-0.5)
                            delta.top_logprobs.add().candidates.add(token_id=token_id, logprob=-0.5)
                send(response=event)
                self.num_tokens_sent[request_id] = num_done
                if self.break_after is not None and step // per_event + 1 >= self.break_after:
                    events.put_nowait(None)
                    return
                await asyncio.sleep(0)
            if hang or abort.is_set():
                await abort.wait()
                self.aborted.add(request_id)
                event = scheduler_pb2.SubmitResponse(num_prompt_tokens=prompt_len)
                for index in range(sampling.n):
                    event.outputs.add(index=index, finish_reason=common_pb2.FINISH_REASON_ABORT)
                send(response=event)
            send(done=True)
            is_complete = True
        finally:
            # the caller went away: grpc cancels the handler task or closes this generator
            if not is_complete:
                self.cancelled.add(request_id)
                self.any_cancelled.set()
            self._abort_events.pop(request_id, None)
            self.drain_rate.record()
            self._is_runnable.pop(request_id, None)

    async def Abort(self, request, context):
        event = self._abort_events.get(request.request_id)
        if event is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id {request.request_id!r} is not running")
        event.set()
        return scheduler_pb2.AbortResponse()

    async def Pause(self, request, context):
        return await self._set_paused(request, context, True, scheduler_pb2.PauseResponse())

    async def Resume(self, request, context):
        return await self._set_paused(request, context, False, scheduler_pb2.ResumeResponse())

    async def _set_paused(self, request, context, is_paused, response):
        runnable = self._is_runnable.get(request.request_id)
        if runnable is None:
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"request_id {request.request_id!r} is not running")
        self.pauses.append((request.request_id, is_paused))
        if is_paused:
            runnable.clear()
        else:
            runnable.set()
        return response

    async def GetLoad(self, request, context):
        return scheduler_pb2.GetLoadResponse()

    async def WatchLoad(self, request, context):
        yield scheduler_pb2.WatchLoadResponse(num_running_requests=len(self._abort_events))
        await asyncio.Event().wait()  # a constant load: nothing more to push

    async def GetServedModel(self, request, context):
        return self.served_model

    async def WatchKvEvents(self, request, context):
        """A scheduler older than KV events: the gateway routes by its own index."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "WatchKvEvents")


async def start_fake_scheduler(fake: FakeScheduler) -> ServiceServer:
    server, _ = create_server([ServiceBinding(
        fake, scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
        "pagedserve.internal.v1.SchedulerService")])
    await server.start()
    await server.set_serving(True)
    return server


def _add_prompt_logprobs(event, prompt_token_ids: list[int], num_top: int) -> None:
    """Each prompt token after the first at logprob -1, then num_top others at -2, -3, ..."""
    for token_id in prompt_token_ids[1:]:
        position = event.prompt_logprobs.add()
        position.candidates.add(token_id=token_id, logprob=-1.0)
        for k in range(num_top):
            position.candidates.add(token_id=5 + k, logprob=-2.0 - k)
