"""The gateway's generation path, shared by every front door (gRPC, HTTP): admission (by count
and by cost), validation, tokenization (off the event loop), submission to the scheduler, and the
request's text deltas (buffered for slow consumers). No transport here: each front door converts
its wire format to a GenerateInput and the StreamDeltas back.

The gateway keeps nothing that must survive it: the count of its live requests (for admission
and draining) is all. A stop string finishes its output in the scheduler (finish_sequence);
leaving `generate` early — the client cancels, its deadline passes — cancels the request there.
Which replica runs a request, and its move to another when that one fails, is the failover
module's; the text stream goes on across the move.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import replace
from typing import TYPE_CHECKING, TypeVar

from pagedserve.services.common.drain_rate import DrainRate
from pagedserve.services.common.engine_api import AbortRequest
from pagedserve.services.common.errors import (
    InvalidRequest,
    Overloaded,
    PagedServeError,
    Reason,
    Unavailable,
)
from pagedserve.services.common.outputs import RequestOutput, Usage
from pagedserve.services.gateway.config import RequestLimitsConfig
from pagedserve.services.gateway.delta_buffer import DeltaBuffer
from pagedserve.services.gateway.failover import ResumableSubmission
from pagedserve.services.gateway.limits import (
    check_fits_replica,
    check_num_token_ids,
    check_prompts_cost,
    check_request_cost,
)
from pagedserve.services.gateway.ownership import ANONYMOUS, Caller, Ownership
from pagedserve.services.gateway.validation import (
    GenerateInput,
    PreparedRequest,
    ServedModel,
    check_request,
    check_request_id,
    check_structured_outputs,
    check_token_ids,
    prepared_request,
    prompt_token_ids,
    tokenized,
)
from pagedserve.services.text.text_stream import TextDelta, TextStream
from pagedserve.services.text.tokenizer import Tokenizer

if TYPE_CHECKING:  # the transport: passed in, never loaded here
    from pagedserve.services.gateway.metrics import GatewayMetrics, RequestTimer
    from pagedserve.services.gateway.replica_set import ReplicaSet

logger = logging.getLogger(__name__)

T = TypeVar("T")
# a token-id prompt up to this long (and no bad words to tokenize) is checked on the event loop:
# one pass over its ids costs less than the hop to the executor thread and back
MAX_INLINE_PROMPT_TOKENS = 2048


class Admission:
    """Live requests of this gateway: refuses over the limit (RESOURCE_EXHAUSTED) and while
    draining (UNAVAILABLE); `wait_idle` is what a drain waits on. A refused client is told to
    come back when, at the rate requests have been finishing, one has left."""

    def __init__(self, max_concurrent_requests: int) -> None:
        self._max_live = max_concurrent_requests
        self._num_live = 0
        self._is_draining = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._drain_rate = DrainRate()

    @contextlib.contextmanager
    def admit(self, num_requests: int = 1) -> Iterator[None]:
        """`num_requests`: what the call counts as (a prompt list, one per prompt), admitted
        together or not at all."""
        if self._is_draining:
            raise Unavailable("the gateway is shutting down; retry on another replica",
                              reason=Reason.GATEWAY_DRAINING, retry_after_s=0.0)
        if self._num_live + num_requests > self._max_live:
            raise Overloaded(f"{self._num_live} requests in flight and {num_requests} asked, the "
                             f"limit (max_concurrent_requests) is {self._max_live}",
                             reason=Reason.RATE_LIMITED,
                             retry_after_s=self._drain_rate.wait_s(
                                 self._num_live + num_requests - self._max_live),
                             metadata={"limit": str(self._max_live),
                                       "limit_name": "max_concurrent_requests"})
        self._num_live += num_requests
        self._idle.clear()
        try:
            yield
        finally:
            self._num_live -= num_requests
            for _ in range(num_requests):
                self._drain_rate.record()
            if self._num_live == 0:
                self._idle.set()

    @property
    def is_draining(self) -> bool:
        return self._is_draining

    def start_draining(self) -> None:
        self._is_draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()


def _needs_tokenizer(request: GenerateInput) -> bool:
    return (request.token_ids is None or len(request.token_ids) > MAX_INLINE_PROMPT_TOKENS
            or bool(request.sampling.bad_words))


StallHandler = Callable[[PagedServeError], Awaitable[None]]


class Frontend:
    """`limits`: what one request may cost (default: the config's defaults). `executor`: where
    prompts are tokenized, off the event loop (default: the loop's default executor);
    `tokenize_executor`: where the tokenize endpoints' work runs (default: `executor`), so that
    they never queue ahead of a generation's prompt. `ownership`: the API key and admin token,
    which decide who owns and who aborts a request."""

    def __init__(self, tokenizer: Tokenizer, replicas: ReplicaSet, model_info: ServedModel,
                 admission: Admission, metrics: GatewayMetrics | None = None,
                 limits: RequestLimitsConfig | None = None,
                 executor: Executor | None = None, ownership: Ownership | None = None,
                 tokenize_executor: Executor | None = None) -> None:
        self.tokenizer = tokenizer
        self.replicas = replicas
        self.info = model_info
        self.admission = admission
        self.metrics = metrics
        self.limits = limits if limits is not None else RequestLimitsConfig()
        self._executor = executor
        self.ownership = ownership if ownership is not None else Ownership()
        self._tokenize_executor = tokenize_executor if tokenize_executor is not None else executor

    @contextlib.contextmanager
    def admit(self, requests: Sequence[GenerateInput]) -> Iterator[None]:
        """One client call of one or more prompts: its whole cost checked, then admitted as that
        many requests (or refused)."""
        check_prompts_cost(requests, self.limits, self.info)
        with self.admission.admit(len(requests)):
            yield

    async def prepare(self, request: GenerateInput, arrival_s: float | None = None
                      ) -> PreparedRequest:
        """Checked (its cost first, so nothing below scales with what it asks), tokenized in the
        executor (a short token-id prompt is only checked, on the loop), and checked against the
        replica's KV cache. `arrival_s`: time.monotonic() when the request reached the front
        door (default: now)."""
        arrival_s = time.monotonic() if arrival_s is None else arrival_s
        check_request_cost(request, self.limits, self.info)
        request_id = check_request(request, self.info)
        if request.sampling.structured_outputs is not None:
            await self._run(self._executor, check_structured_outputs, request.sampling)
            if self.metrics is not None:
                self.metrics.record_structured_output(request.sampling.structured_outputs.kind)
        if _needs_tokenizer(request):
            token_ids, sampling = await self._run(self._executor, tokenized, request,
                                                  self.tokenizer, self.info)
        else:
            token_ids, sampling = tokenized(request, self.tokenizer, self.info)
        check_fits_replica(len(token_ids), sampling, self.info)
        return prepared_request(replace(request, sampling=sampling), request_id,
                                token_ids, self.info, arrival_s)

    async def prompt_token_ids(self, request: GenerateInput) -> list[int]:
        """An admitted request's prompt, checked and tokenized as `prepare` does."""
        check_request_cost(request, self.limits, self.info)
        return await self._run(self._executor, prompt_token_ids, request, self.tokenizer,
                               self.info)

    async def decode(self, token_ids: Sequence[int]) -> str:
        """An admitted request's checked token ids as text (echo)."""
        return await self._run(self._executor, self.tokenizer.decode, token_ids)

    async def tokenize(self, request: GenerateInput) -> list[int]:
        """A call of its own: admitted, with a generation prompt's limits, in the tokenize
        executor."""
        check_request_cost(request, self.limits, self.info)
        with self.admission.admit():
            return await self._run(self._tokenize_executor, prompt_token_ids, request,
                                   self.tokenizer, self.info)

    async def detokenize(self, token_ids: Sequence[int], field: str) -> str:
        """A call of its own, as `tokenize`; `field`: what the ids are called in the request."""
        check_num_token_ids(field, len(token_ids), self.info)
        check_token_ids(field, token_ids, self.info.vocab_size, field)
        with self.admission.admit():
            return await self._run(self._tokenize_executor, self.tokenizer.decode, token_ids)

    @staticmethod
    async def _run(executor: Executor | None, fn: Callable[..., T], *args: object) -> T:
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    async def abort(self, request_id: str, caller: Caller = ANONYMOUS) -> None:
        """Forwarded to every scheduler replica, so any gateway can abort any request of the
        same caller (or any request, for an admin: see ownership); the request's own stream
        then ends with finish_reason "abort"."""
        if not request_id:
            raise InvalidRequest("request_id must not be empty, got ''",
                                 reason=Reason.INVALID_REQUEST_ID, field="request_id")
        check_request_id(request_id)
        await self.replicas.abort(AbortRequest(request_id, self.ownership.owner(caller),
                                               self.ownership.is_admin(caller)))

    async def generate(self, request: PreparedRequest, on_stalled: StallHandler | None = None,
                       caller: Caller = ANONYMOUS) -> AsyncIterator[TextDelta]:
        """The request's text deltas until every output has finished. A request the scheduler
        ends early raises Unavailable; outputs that failed raise PagedServeError at the end.

        The scheduler's stream is drained into a bounded DeltaBuffer by a task of its own, so a
        slow consumer never holds back the engine; while the consumer leaves more than
        max_unread_stream_tokens tokens unread the request is paused in its scheduler (it costs
        the engine no steps), and resumed once half are read. A consumer that does not come
        back for the next delta within stalled_stream_timeout_s (a front door stuck writing to a client that
        stopped reading) loses its request: the scheduler call is cancelled (its blocks freed),
        `on_stalled` is awaited with the error (a front door ends its call with it), and the
        task iterating this generator is cancelled."""
        buffer = DeltaBuffer(request.sampling.n, self.limits.stream_interval)
        timer = None if self.metrics is None else self.metrics.start_request(
            request.arrival_s, request.operation)
        text_stream = TextStream(request.prompt_token_ids, request.sampling, self.tokenizer)
        submission = ResumableSubmission(self.replicas, request, self.ownership.owner(caller),
                                         self.replicas.config.failover_timeout_s,
                                         text_stream.is_output_finished, self.metrics)
        pump = asyncio.create_task(self._pump(request, text_stream, submission, buffer, timer))
        watchdog = asyncio.create_task(self._watch(request.request_id, buffer, pump,
                                                   asyncio.current_task(), on_stalled))
        tasks = [watchdog, pump]
        if self.limits.max_unread_stream_tokens > 0:
            tasks.append(asyncio.create_task(self._regulate(buffer, submission)))
        errors: list[str] = []
        try:
            while (delta := await buffer.get()) is not None:
                if delta.error:
                    errors.append(f"output {delta.index}: {delta.error}")
                yield delta
        finally:
            for task in tasks:
                task.cancel()
        if errors:
            raise PagedServeError(f"request {request.request_id!r} failed: {'; '.join(errors)}",
                                  reason=Reason.GENERATION_FAILED)

    async def embed(self, request: PreparedRequest, caller: Caller = ANONYMOUS) -> list[float]:
        """An embedding request's vector: its prompt runs through a replica's scheduler as a
        prompt-only request (is_pooling), failing over like a generation; nothing is generated
        and its blocks are freed when its prompt is computed. Leaving early cancels it."""
        request = dataclasses.replace(request, is_pooling=True)
        timer = None if self.metrics is None else self.metrics.start_request(
            request.arrival_s, "embeddings")
        submission = ResumableSubmission(self.replicas, request, self.ownership.owner(caller),
                                         self.replicas.config.failover_timeout_s,
                                         lambda _: False, self.metrics)
        async with contextlib.aclosing(submission.outputs()) as outputs:
            async for output in outputs:
                errors = [o.error for o in output.outputs if o.error]
                if errors:
                    raise PagedServeError(f"request {request.request_id!r} failed: "
                                          f"{'; '.join(errors)}", reason=Reason.GENERATION_FAILED)
                if output.embedding is not None:
                    if timer is not None:
                        timer.finished(Usage(output.num_prompt_tokens, 0,
                                             output.num_cached_tokens))
                    return output.embedding
        raise Unavailable(f"the scheduler ended request {request.request_id!r} before its "
                          "embedding", reason=Reason.SCHEDULER_UNAVAILABLE)

    async def _pump(self, request: PreparedRequest, text_stream: TextStream,
                    submission: ResumableSubmission, buffer: DeltaBuffer,
                    timer: RequestTimer | None) -> None:
        """Scheduler events → text deltas → buffer, until every output has ended or the stream
        fails; each event is handled where the scheduler call's reader hands it over, so this
        task wakes once at the end, not per event. An output a stop string ended is finished in
        the scheduler at once, the last one too (so the request ends there as stopped, not
        aborted), before the call is left."""
        def on_output(output: RequestOutput) -> bool:
            if timer is not None:
                for completion in output.outputs:
                    if completion.token_ids:
                        timer.on_tokens()
                        break
            for delta in text_stream.on_output(output):
                buffer.put(delta)
            for index in text_stream.take_stopped():
                submission.finish_sequence(index)
            return text_stream.is_finished

        try:
            await submission.run(on_output)
        except Exception as exc:
            buffer.close(exc)
            return
        if not text_stream.is_finished:
            buffer.close(Unavailable(f"the scheduler ended request {request.request_id!r} "
                                     "before every output finished",
                                     reason=Reason.SCHEDULER_UNAVAILABLE))
            return
        buffer.close()
        if timer is not None:
            timer.finished(text_stream.usage)

    async def _regulate(self, buffer: DeltaBuffer, submission: ResumableSubmission) -> None:
        """Backpressure: pause the request while its consumer is behind; hysteresis (resume at
        half) keeps a reader that takes bursts from pausing it every step."""
        max_unread = self.limits.max_unread_stream_tokens
        while True:
            await buffer.wait_unread(lambda n: n > max_unread)
            await submission.set_paused(True)
            await buffer.wait_unread(lambda n: n <= max_unread // 2)
            await submission.set_paused(False)

    async def _watch(self, request_id: str, buffer: DeltaBuffer, pump: asyncio.Task[None],
                     consumer: asyncio.Task[object] | None, on_stalled: StallHandler | None
                     ) -> None:
        timeout_s = self.limits.stalled_stream_timeout_s
        await buffer.wait_stalled(timeout_s)
        pump.cancel()
        error = Overloaded(f"request {request_id!r} aborted: its client stopped reading its "
                           f"stream for stalled_stream_timeout_s={timeout_s:g}",
                           reason=Reason.STREAM_STALLED)
        logger.warning("%s (%d deltas pending)", error, len(buffer))
        buffer.close(error)
        try:
            if on_stalled is not None:
                await on_stalled(error)
        finally:
            if consumer is not None:
                consumer.cancel()
