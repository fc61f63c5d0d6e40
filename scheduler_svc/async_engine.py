"""The scheduler service's engine loop: EngineCore driven from asyncio.

EngineCore is not thread-safe: the engine thread runs its steps, and the event loop applies the
queued operations (add, abort, pause, finish_sequence) only between two steps. While none is queued the engine
thread steps on by itself, handing each step's outputs to the event loop without waiting for it:
the event loop's turn (streaming the outputs, admitting requests) stays off the path from one
step's result to the next plan. One queued while step n runs holds step n+2's plan back until
the event loop has applied it (step n+1 keeps the workers busy meanwhile), so a new request is
in the first step planned after its arrival, not behind two steps planned without it. A request
whose consumer leaves queues an abort that runs before the next step, so its blocks are free by
then. Each step is a span in the trace of the oldest live request, linked to the request spans of
the others it ran.
Stats: the engine feeds its stat loggers on the engine thread; every `stats_interval_s` a timer on
the event loop logs vLLM's stats line (LoggingStatLogger).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanContext, Status, StatusCode
from pagedserve.scheduler_svc.engine_core import EngineCore
from pagedserve.scheduler_svc.outputs import merge_request_outputs
from pagedserve.scheduler_svc.scheduler import ScheduledStep
from pagedserve.scheduler_svc.stats import LoggingStatLogger, StatLogger
from pagedserve.services.common.engine_api import (
    AbortRequest,
    EngineLoad,
    PauseRequest,
    SubmitRequest,
)
from pagedserve.services.common.errors import InvalidRequest, NotFound, Reason, Unavailable
from pagedserve.services.common.outputs import FinishReason, RequestOutput

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException  # what a request's queue carries; an exception ends it


class OutputSink(Protocol):
    """Where a request's outputs go as each step ends (an asyncio.Queue is one)."""

    def put_nowait(self, item: _Item) -> None: ...

STEP_SPAN = "engine_step"
STEP_ID = "pagedserve.step_id"
NUM_SEQS = "pagedserve.num_seqs"
NUM_SCHEDULED_TOKENS = "pagedserve.num_scheduled_tokens"
NUM_PREEMPTED = "pagedserve.num_preempted"


class RequestStream:
    """One request's outputs; leaving `async with stream:` early aborts the request."""

    def __init__(self, request_id: str, queue: asyncio.Queue[_Item],
                 on_abandon: Callable[[str], None]) -> None:
        self.request_id = request_id
        self._queue = queue
        self._on_abandon = on_abandon
        self._is_finished = False
        self._held: _Item | None = None  # an error queued behind the reports merged last

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        """The reports queued since the last call, merged into one: a consumer behind the engine
        sends one event per call, not one per step."""
        if self._is_finished:
            raise StopAsyncIteration
        item, self._held = self._held or await self._queue.get(), None
        while isinstance(item, RequestOutput) and not item.finished and not self._queue.empty():
            later = self._queue.get_nowait()
            if isinstance(later, BaseException):
                self._held = later
                break
            item = merge_request_outputs(item, later)
        if isinstance(item, BaseException):
            self._is_finished = True
            raise item
        self._is_finished = item.finished
        return item

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._is_finished:
            self._is_finished = True
            self._on_abandon(self.request_id)


class EngineService:
    def __init__(self, engine: EngineCore, executor: ThreadPoolExecutor, stop_timeout_s: float
                 ) -> None:
        self.engine = engine
        self._executor = executor
        self._stop_timeout_s = stop_timeout_s
        self._engine_call: Future | None = None
        self._streams: dict[str, OutputSink] = {}
        self._pending: list[tuple[Callable[[], Any], asyncio.Future | None]] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is live (drain waits on it)
        self._idle.set()
        self._is_stepping = False
        self._loop = asyncio.get_running_loop()  # the engine thread hands its outputs to it
        self._has_pending = False  # read by the engine thread between its steps
        self._is_stopping = False
        self._is_accepting = True
        self._load = engine.get_load()
        self._load_changed = asyncio.Event()  # set, then replaced, when _load changes
        self._task: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        self._tracer = trace.get_tracer(__name__)
        self._span_contexts: dict[str, SpanContext] = {}
        self._num_preemptions = engine.scheduler.num_preemptions  # as of the last step sent
        engine.step_observer = self

    @classmethod
    async def start(cls, build_engine: Callable[[], EngineCore], stop_timeout_s: float,
                    stat_loggers: list[StatLogger] | None = None,
                    stats_interval_s: float = 0.0) -> EngineService:
        """`build_engine` (the blocking worker handshake) on the engine thread, then the loop;
        `stats_interval_s` > 0 logs the stats line."""
        executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        engine = await asyncio.get_running_loop().run_in_executor(executor, build_engine)
        engine.stat_loggers.extend(stat_loggers or ())
        service = cls(engine, executor, stop_timeout_s)
        service._task = asyncio.create_task(service._run(), name="engine-loop")
        if stats_interval_s > 0:
            stat_line = LoggingStatLogger()
            engine.stat_loggers.append(stat_line)
            service._stats_task = asyncio.create_task(
                service._log_stats(stat_line, stats_interval_s), name="engine-stats")
        return service

    @property
    def load(self) -> EngineLoad:
        """The load as of the latest loop turn; readable from any thread."""
        return self._load

    async def watch_load(self, min_interval_s: float) -> AsyncIterator[EngineLoad]:
        """The load now, then each time it changes, at most once per min_interval_s."""
        sent = None
        while True:
            changed = self._load_changed  # taken before reading: a change after it wakes us
            load = self.get_load()
            if load == sent:
                await changed.wait()
                continue
            sent = load
            yield load
            await asyncio.sleep(min_interval_s)

    def _set_load(self, load: EngineLoad) -> None:
        if load != self._load:
            self._load_changed.set()
            self._load_changed = asyncio.Event()
        self._load = load

    async def _log_stats(self, stat_line: LoggingStatLogger, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            stat_line.log(self._load)

    async def submit(self, request: SubmitRequest, sink: OutputSink | None = None
                     ) -> RequestStream:
        """Queue the request; bad input raises InvalidRequest, a full queue Overloaded. Its
        arrival (the FCFS key) is now. Iterate the stream for its outputs, or, with `sink`, each
        step's output (or the exception that ends it) goes there instead; closing the stream
        before the request finished aborts the request."""
        if not self._is_accepting:
            raise Unavailable("the scheduler is draining and accepts no new requests",
                              reason=Reason.SCHEDULER_DRAINING, retry_after_s=0.0)
        request_id = request.request_id
        queue: asyncio.Queue[_Item] = asyncio.Queue()
        outputs = queue if sink is None else sink
        span_context = trace.get_current_span().get_span_context()

        def add() -> None:
            self.engine.check_admission(request.prompt_token_ids, request.sampling)
            self.engine.add_request(request_id, request.prompt_token_ids, request.sampling,
                                    request.priority, owner=request.owner,
                                    resumed={o.index: o.token_ids
                                             for o in request.resumed_outputs})
            self._streams[request_id] = outputs
            if span_context.is_valid:
                self._span_contexts[request_id] = span_context
            self._idle.clear()

        try:
            await self._call(add)
        except asyncio.CancelledError:
            self._drop(request_id)  # added just before the cancel: abort it again
            raise
        return RequestStream(request_id, queue, self._drop)

    async def abort(self, request: AbortRequest) -> None:
        """Finish the request with "abort" (its stream gets the final outputs); NotFound if it is
        unknown, already finished, or another owner's (unless the caller is an admin)."""
        owner = None if request.is_admin else request.owner

        def abort() -> None:
            self._push(self.engine.abort_request(request.request_id, owner))

        return await self._call(abort)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """Output `index` ends with STOP before the next step (its caller matched a stop string):
        its blocks are freed, its siblings go on; the stream gets the final report if that ended
        the request. One that ended meanwhile is left as it is."""

        def finish() -> None:
            try:
                report = self.engine.finish_sequence(request_id, index)
            except (NotFound, InvalidRequest) as exc:
                logger.debug("finish_sequence(%r, %d) ignored: %s", request_id, index, exc)
                return
            if report is not None:
                self._push(report)

        self._queue(finish)

    async def set_paused(self, request: PauseRequest) -> None:
        """Pause or resume the request before the next step (backpressure from its consumer);
        NotFound as for abort, with no admin override."""
        if request.is_paused:
            pause = self.engine.pause_request
        else:
            pause = self.engine.resume_request
        return await self._call(lambda: pause(request.request_id, request.owner))

    def get_load(self) -> EngineLoad:
        """Live when the engine is between steps; during a step, as of just before it."""
        return self._load if self._is_stepping else self.engine.get_load()

    async def drain(self, timeout_s: float) -> None:
        """Refuse new requests; wait at most timeout_s for the live ones."""
        self._is_accepting = False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), timeout_s)

    async def stop(self) -> bool:
        """End the loop (live requests get UNAVAILABLE); True once the engine thread is idle.
        Only then may the worker channels close: grpc can crash closing one under a call."""
        self._is_accepting = False
        self._is_stopping = True
        for task in (self._task, self._stats_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for request_id in list(self._streams):
            self._end(request_id, Unavailable("the scheduler is shutting down",
                                              reason=Reason.SCHEDULER_DRAINING,
                                              retry_after_s=0.0))
        self._executor.shutdown(wait=False, cancel_futures=True)
        call = self._engine_call
        if call is None or call.done():
            return True
        done, _ = await asyncio.to_thread(futures.wait, [call], self._stop_timeout_s)
        if not done:
            logger.warning("the engine thread is still busy after %.1f s", self._stop_timeout_s)
        return bool(done)

    def _call(self, fn: Callable[[], Any]) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((fn, future))
        self._has_pending = True
        self._wakeup.set()
        return future

    def _drop(self, request_id: str) -> None:
        """The consumer left: forget its stream now, abort the request before the next step."""
        if self._streams.pop(request_id, None) is None:
            return
        self._update_idle()

        def abort() -> None:
            with contextlib.suppress(NotFound):
                self.engine.abort_request(request_id)
                logger.info("request %s aborted: its caller went away", request_id)

        self._queue(abort)

    def _queue(self, fn: Callable[[], None]) -> None:
        """Run before the next step; nobody waits for it (a failure is logged)."""
        self._pending.append((fn, None))
        self._has_pending = True
        self._wakeup.set()

    async def _run(self) -> None:
        while True:
            self._apply_pending()
            self._set_load(self.engine.get_load())  # what GetLoad answers during the next step
            if not self.engine.has_runnable_requests():  # none, or every one paused
                if self.engine.has_step_in_flight:
                    await self._step(self.engine.drain)
                    continue
                self._wakeup.clear()
                if not self._pending:
                    await self._wakeup.wait()
                continue
            await self._step(self._steps)

    async def _step(self, step: Callable[[], list[RequestOutput]]) -> None:
        self._is_stepping = True
        try:
            self._engine_call = self._executor.submit(step)
            outputs = await asyncio.wrap_future(self._engine_call)
        except Exception as exc:  # EngineCore contains worker failures; this is a bug
            logger.exception("engine step raised; failing every live request")
            self._fail_all(exc)
            return
        finally:
            self._is_stepping = False
        self._after_step(outputs)

    def _steps(self) -> list[RequestOutput]:
        """On the engine thread: steps while nothing is queued for the engine, each step's
        outputs and load handed to the event loop; the last step's are returned."""
        loop = self._loop
        while True:
            outputs = self.engine.step(lambda: self._has_pending)
            if (self._has_pending or self._is_stopping
                    or not self.engine.has_runnable_requests()):
                return outputs
            loop.call_soon_threadsafe(self._after_step, outputs, self.engine.get_load())

    def _after_step(self, outputs: list[RequestOutput], load: EngineLoad | None = None) -> None:
        for output in outputs:
            self._push(output)
        if load is not None:
            self._set_load(load)

    @contextlib.contextmanager
    def step_sent(self, scheduled: ScheduledStep) -> Iterator[trace.Span]:
        """On the engine thread; the event loop changes the span contexts only between steps."""
        parent = self._step_span_parent()
        span = self._tracer.start_span(STEP_SPAN, context=_context_of(parent))
        num_preemptions = self.engine.scheduler.num_preemptions
        if span.is_recording():
            span.set_attributes({
                STEP_ID: scheduled.plan.step_id, NUM_SEQS: len(scheduled.scheduled),
                NUM_SCHEDULED_TOKENS: scheduled.plan.num_scheduled_tokens,
                NUM_PREEMPTED: num_preemptions - self._num_preemptions})
            request_ids = dict.fromkeys(item.group.request_id for item in scheduled.scheduled)
            for request_id in request_ids:
                span_context = self._span_contexts.get(request_id)
                if span_context is not None and span_context != parent:
                    span.add_link(span_context)
        self._num_preemptions = num_preemptions
        with trace.use_span(span, end_on_exit=False):
            yield span

    def step_done(self, span: trace.Span, scheduled: ScheduledStep,
                  outputs: list[RequestOutput]) -> None:
        if span.is_recording():
            request_ids = {item.group.request_id for item in scheduled.scheduled}
            errors = [o.error for r in outputs if r.request_id in request_ids
                      for o in r.outputs if o.finish_reason == FinishReason.ERROR]
            if errors:
                span.set_status(Status(StatusCode.ERROR, errors[0]))
        span.end()

    def _step_span_parent(self) -> SpanContext | None:
        """The span of the oldest live request (its SubmitStream request span)."""
        for request_id in [r for r in self._span_contexts if r not in self._streams]:
            del self._span_contexts[request_id]
        return next(iter(self._span_contexts.values()), None)

    def _apply_pending(self) -> None:
        self._has_pending = False
        pending, self._pending = self._pending, []
        for fn, future in pending:
            if future is not None and future.cancelled():
                continue  # its caller is gone
            try:
                result = fn()
            except Exception as exc:
                if future is None:
                    logger.exception("queued engine operation failed")
                elif not future.done():
                    future.set_exception(exc)
            else:
                if future is not None and not future.done():
                    future.set_result(result)

    def _push(self, output: RequestOutput) -> None:
        queue = self._streams.get(output.request_id)
        if queue is None:
            return  # its caller left; the abort is queued
        queue.put_nowait(output)
        if output.finished:
            del self._streams[output.request_id]
            self._update_idle()

    def _end(self, request_id: str, exc: BaseException) -> None:
        queue = self._streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(exc)
        self._update_idle()

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._streams):
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
            self._end(request_id, RuntimeError(f"engine step failed: {exc}"))

    def _update_idle(self) -> None:
        if not self._streams:
            self._idle.set()


def _context_of(parent: SpanContext | None) -> Context:
    if parent is None:
        return Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), Context())
