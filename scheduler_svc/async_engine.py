"""AsyncEngine: the scheduler's EngineCore driven from asyncio, each request's outputs into the
sink its caller gave (scheduler_svc/submit_stream.py gives one per request of a SubmitStream call).

EngineCore is not thread-safe: the engine thread runs its steps, and the event loop applies the
queued operations (add, abort, pause, finish_sequence) only between two steps. While none is
queued the engine thread steps on by itself, handing each step's outputs to the event loop
without waiting for it: the event loop's turn (streaming the outputs, admitting requests) stays
off the path from one step's result to the next plan. One queued while step n runs holds step
n+2's plan back until the event loop has applied it (step n+1 keeps the workers busy meanwhile),
so a new request is in the first step planned after its arrival, not behind two steps planned
without it. A request whose consumer leaves (`drop`) queues an abort that runs before the next
step, so its blocks are free by then. Each step is a span in the trace of the oldest live
request, linked to the request spans of the others it ran.
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
from pagedserve.services.common.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

_Item = RequestOutput | BaseException  # what a request's sink gets; an exception ends it


class OutputSink(Protocol):
    """Where a request's outputs go as each step ends (an asyncio.Queue is one)."""

    def put_nowait(self, item: _Item) -> None: ...

STEP_SPAN = "engine_step"
STEP_ID = "pagedserve.step_id"
NUM_SEQS = "pagedserve.num_seqs"
NUM_SCHEDULED_TOKENS = "pagedserve.num_scheduled_tokens"
NUM_PREEMPTED = "pagedserve.num_preempted"


class AsyncEngine:
    """EngineCore on its own thread, stepped from an asyncio event loop."""

    def __init__(self, core: EngineCore, executor: ThreadPoolExecutor, stop_timeout_s: float
                 ) -> None:
        self.core = core
        self._executor = executor
        self._stop_timeout_s = stop_timeout_s
        self._engine_call: Future | None = None
        self._sinks: dict[str, OutputSink] = {}
        self._pending: list[tuple[Callable[[], Any], asyncio.Future | None]] = []
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()  # set while no request is live (drain waits on it)
        self._idle.set()
        self._is_stepping = False
        self._loop = asyncio.get_running_loop()  # the engine thread hands its outputs to it
        self._has_pending = False  # read by the engine thread between its steps
        self._is_stopping = False
        self._is_accepting = True
        self._load = core.get_load()
        self._load_changed = asyncio.Event()  # set, then replaced, when _load changes
        self._stepped = asyncio.Event()  # set, then replaced, after each step
        self._task: asyncio.Task | None = None
        self._stats_task: asyncio.Task | None = None
        self._tracer = trace.get_tracer(__name__)
        self._span_contexts: dict[str, SpanContext] = {}
        self._num_preemptions = core.scheduler.num_preemptions  # as of the last step sent
        core.step_observer = self

    @classmethod
    async def start(cls, build_engine: Callable[[], EngineCore], stop_timeout_s: float,
                    stat_loggers: list[StatLogger] | None = None,
                    stats_interval_s: float = 0.0) -> AsyncEngine:
        """`build_engine` (the blocking worker handshake) on the engine thread, then the loop;
        `stats_interval_s` > 0 logs the stats line."""
        executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        core = await asyncio.get_running_loop().run_in_executor(executor, build_engine)
        core.stat_loggers.extend(stat_loggers or ())
        engine = cls(core, executor, stop_timeout_s)
        engine._task = asyncio.create_task(engine._run(), name="engine-loop")
        if stats_interval_s > 0:
            stat_line = LoggingStatLogger()
            core.stat_loggers.append(stat_line)
            engine._stats_task = asyncio.create_task(
                engine._log_stats(stat_line, stats_interval_s), name="engine-stats")
        return engine

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

    async def submit(self, request: SubmitRequest, sink: OutputSink) -> None:
        """Queue the request; bad input raises InvalidRequest, a full queue Overloaded. Its
        arrival (the FCFS key) is now. Each step's output (or the exception that ends it) goes to
        `sink`; `drop` before the request finished aborts it."""
        if not self._is_accepting:
            raise Unavailable("the scheduler is draining and accepts no new requests",
                              reason=Reason.SCHEDULER_DRAINING, retry_after_s=0.0)
        request_id = request.request_id
        span_context = trace.get_current_span().get_span_context()

        def add() -> None:
            self.core.check_admission(request.prompt_token_ids, request.sampling)
            self.core.add_request(request_id, request.prompt_token_ids, request.sampling,
                                  request.priority, owner=request.owner,
                                  resumed={o.index: o.token_ids
                                           for o in request.resumed_outputs},
                                  is_pooling=request.is_pooling)
            self._sinks[request_id] = sink
            if span_context.is_valid:
                self._span_contexts[request_id] = span_context
            self._idle.clear()

        try:
            await self._grammar_compiled(request_id, request.sampling)
            await self._call(add)
        except asyncio.CancelledError:
            self.drop(request_id, sink)  # added just before the cancel: abort it again
            raise

    async def _grammar_compiled(self, request_id: str, sampling: SamplingParams) -> None:
        """A constrained request waits here for its grammar's compile, not in a step."""
        compiled = self.core.prepare_grammars(sampling)
        if compiled is None:
            return
        try:
            await asyncio.wrap_future(compiled)
        except Exception as exc:  # its first step compiles it, and waits for that
            logger.warning("request %s: its grammar was not compiled ahead: %s", request_id, exc)

    async def abort(self, request: AbortRequest) -> None:
        """Finish the request with "abort" (its stream gets the final outputs); NotFound if it is
        unknown, already finished, or another owner's (unless the caller is an admin)."""
        owner = None if request.is_admin else request.owner

        def abort() -> None:
            self._push(self.core.abort_request(request.request_id, owner))

        return await self._call(abort)

    def finish_sequence(self, request_id: str, index: int) -> None:
        """Output `index` ends with STOP before the next step (its caller matched a stop string):
        its blocks are freed, its siblings go on; the stream gets the final report if that ended
        the request. One that ended meanwhile is left as it is."""

        def finish() -> None:
            try:
                report = self.core.finish_sequence(request_id, index)
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
            pause = self.core.pause_request
        else:
            pause = self.core.resume_request
        return await self._call(lambda: pause(request.request_id, request.owner))

    def get_load(self) -> EngineLoad:
        """Live when the engine is between steps; during a step, as of just before it."""
        return self._load if self._is_stepping else self.core.get_load()

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
        for request_id in list(self._sinks):
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

    def call(self, fn: Callable[[], Any]) -> asyncio.Future:
        """`fn` on the engine thread's turn before the next step; its result (or exception)."""
        return self._call(fn)

    def queue(self, fn: Callable[[], None]) -> None:
        """`fn` before the next step, in order with `call`; nobody waits for it."""
        self._queue(fn)

    def _call(self, fn: Callable[[], Any]) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._pending.append((fn, future))
        self._has_pending = True
        self._wakeup.set()
        return future

    def drop(self, request_id: str, sink: OutputSink) -> None:
        """The consumer left: forget its sink now, abort the request before the next step. A
        request that ended already, or whose id is live again with another sink, is left."""
        if self._sinks.get(request_id) is not sink:
            return
        del self._sinks[request_id]
        self._update_idle()

        def abort() -> None:
            with contextlib.suppress(NotFound):
                self.core.abort_request(request_id)
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
            self._set_load(self.core.get_load())  # what GetLoad answers during the next step
            if not self.core.has_runnable_requests():  # none, or every one paused
                if self.core.has_step_in_flight:
                    await self._step(self.core.drain)
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
            outputs = self.core.step(lambda: self._has_pending)
            if (self._has_pending or self._is_stopping
                    or not self.core.has_runnable_requests()):
                return outputs
            loop.call_soon_threadsafe(self._after_step, outputs, self.core.get_load())

    async def wait_for_step(self) -> None:
        await self._stepped.wait()

    def _after_step(self, outputs: list[RequestOutput], load: EngineLoad | None = None) -> None:
        self._stepped.set()
        self._stepped = asyncio.Event()
        for output in outputs:
            self._push(output)
        if load is not None:
            self._set_load(load)

    @contextlib.contextmanager
    def step_sent(self, scheduled: ScheduledStep) -> Iterator[trace.Span]:
        """On the engine thread; the event loop changes the span contexts only between steps."""
        parent = self._step_span_parent()
        span = self._tracer.start_span(STEP_SPAN, context=_context_of(parent))
        num_preemptions = self.core.scheduler.num_preemptions
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
        for request_id in [r for r in self._span_contexts if r not in self._sinks]:
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
        sink = self._sinks.get(output.request_id)
        if sink is None:
            return  # its caller left; the abort is queued
        sink.put_nowait(output)
        if output.finished:
            del self._sinks[output.request_id]
            self._update_idle()

    def _end(self, request_id: str, exc: BaseException) -> None:
        sink = self._sinks.pop(request_id, None)
        if sink is not None:
            sink.put_nowait(exc)
        self._update_idle()

    def _fail_all(self, exc: Exception) -> None:
        for request_id in list(self._sinks):
            with contextlib.suppress(Exception):
                self.core.abort_request(request_id)
            self._end(request_id, RuntimeError(f"engine step failed: {exc}"))

    def _update_idle(self) -> None:
        if not self._sinks:
            self._idle.set()


def _context_of(parent: SpanContext | None) -> Context:
    if parent is None:
        return Context()
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), Context())
