"""One HTTP request's prompts through the Frontend: admitted and prepared up front (so refusals
and bad input answer with their status before any byte is streamed), then their deltas
interleaved as they come. Leaving early closes every prompt's stream, which aborts it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import TypeVar

from pagedserve.services.common.errors import PagedServeError, Unavailable
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.openai import sse
from pagedserve.services.gateway.openai.http_span import (
    record_finish_reason,
    record_usage,
)
from pagedserve.services.gateway.ownership import Caller, caller_of
from pagedserve.services.gateway.validation import GenerateInput, PreparedRequest
from pagedserve.services.text.text_stream import TextDelta
from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

T = TypeVar("T")


class Submission:
    """Admitted, prepared prompts (`open`, or `admit` then `prepare`); `close` gives their
    admission back (idempotent). `stalled` is set when the Frontend gave up on a consumer that
    stopped reading (its request already aborted): the response writing to that client is then
    cancelled."""

    def __init__(self, frontend: Frontend, request: Request) -> None:
        """`request`: the HTTP request, whose caller owns the prompts' requests (ownership)."""
        self._frontend = frontend
        self._caller = http_caller(request)
        self._arrival_s = arrival_time(request)
        self._admitted = contextlib.ExitStack()
        self.prepared: list[PreparedRequest] = []
        self.stalled = asyncio.Event()

    @classmethod
    def admit(cls, frontend: Frontend, inputs: list[GenerateInput],
              request: Request) -> Submission:
        """The inputs' whole cost checked, then admitted as one request each, before anything
        is built per prompt or per output."""
        submission = cls(frontend, request)
        submission._admitted.enter_context(frontend.admit(inputs))
        return submission

    @classmethod
    async def open(cls, frontend: Frontend, inputs: list[GenerateInput],
                   request: Request) -> Submission:
        submission = cls.admit(frontend, inputs, request)
        await submission.prepare(inputs)
        return submission

    async def prepare(self, inputs: list[GenerateInput]) -> None:
        """Closed if one fails."""
        try:
            for one in inputs:
                self.prepared.append(await self._frontend.prepare(one, self._arrival_s))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self._admitted.close()

    async def _on_stalled(self, error: PagedServeError) -> None:
        self.stalled.set()

    def _generate(self, request: PreparedRequest) -> AsyncGenerator[TextDelta, None]:
        return self._frontend.generate(  # type: ignore[return-value]
            request, self._on_stalled, self._caller)

    async def deltas(self) -> AsyncGenerator[tuple[int, TextDelta], None]:
        """(prompt index, delta) until every prompt has finished; their usage and finish
        reasons go on the request's span. One prompt's deltas pass through no other generator
        (this is every streamed token's path)."""
        if len(self.prepared) == 1:
            async with contextlib.aclosing(self._generate(self.prepared[0])) as deltas:
                async for delta in deltas:
                    _record(delta)
                    yield 0, delta
            return
        async with contextlib.aclosing(self._interleaved()) as interleaved:
            async for index, delta in interleaved:
                _record(delta)
                yield index, delta

    async def _interleaved(self) -> AsyncGenerator[tuple[int, TextDelta], None]:
        # bounded, so that a client that stops reading stalls the Frontend's own buffers
        queue: asyncio.Queue[tuple[int, TextDelta | None, BaseException | None]] = \
            asyncio.Queue(maxsize=len(self.prepared))

        async def pump(index: int, request: PreparedRequest) -> None:
            try:
                async with contextlib.aclosing(self._generate(request)) as deltas:
                    async for delta in deltas:
                        await queue.put((index, delta, None))
            except Exception as exc:
                await queue.put((index, None, exc))
                return
            await queue.put((index, None, None))

        tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(self.prepared)]
        try:
            num_running = len(tasks)
            while num_running:
                index, delta, error = await queue.get()
                if error is not None:
                    raise error
                if delta is None:
                    num_running -= 1
                else:
                    yield index, delta
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


def _record(delta: TextDelta) -> None:
    if delta.usage is not None:
        record_usage(delta.usage)
    if delta.finish_reason is not None:
        record_finish_reason(delta.finish_reason)


class StartedDeltas:
    """A submission's deltas once the first one came: a scheduler that is gone or refuses the
    request raises while the HTTP status can still say so, not inside a 200 event stream.
    Close it (`aclose`) to abort what still runs."""

    def __init__(self, first: tuple[int, TextDelta] | None,
                 rest: AsyncGenerator[tuple[int, TextDelta], None]) -> None:
        self._first = first
        self._rest = rest

    @classmethod
    async def start(cls, submission: Submission, request: Request) -> StartedDeltas:
        deltas = submission.deltas()
        try:
            first = await unless_disconnected(request, anext(deltas, None))
        except BaseException:
            await deltas.aclose()
            raise
        return cls(first, deltas)

    def __aiter__(self) -> StartedDeltas:
        return self

    async def __anext__(self) -> tuple[int, TextDelta]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        await self._rest.aclose()


def arrival_time(request: Request) -> float | None:
    """time.monotonic() when the request reached the gateway (the ArrivalTime middleware)."""
    return getattr(request.state, "arrival_s", None)


def http_caller(request: Request) -> Caller:
    """The caller as ownership sees it: its credential, else its host, written as gRPC writes
    a peer's host, so that a host is one caller at both doors."""
    host = request.client.host if request.client else ""
    if host:
        host = f"ipv6:[{host}]" if ":" in host else f"ipv4:{host}"
    return caller_of(request.headers.get("authorization", ""), peer_host=host)


async def respond(submission: Submission, request: Request, stream: bool,
                  events: Callable[[StartedDeltas], AsyncIterator[str]],
                  whole: Callable[[Submission], Awaitable[BaseModel]]) -> Response:
    """The submission's answer: an SSE stream of `events`, or the `whole` body once done."""
    if stream:
        try:
            deltas = await StartedDeltas.start(submission, request)
        except BaseException:
            submission.close()
            raise
        return sse.EventStreamResponse(events(deltas), submission.close, submission.stalled)
    try:
        result = await unless_disconnected(request, whole(submission))
    finally:
        submission.close()
    return Response(result.model_dump_json(), media_type="application/json")


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled (so its requests abort) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait((task, disconnect), return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            raise Unavailable("the client disconnected")
        return task.result()
    finally:
        for pending in (task, disconnect):
            pending.cancel()
        await asyncio.gather(task, disconnect, return_exceptions=True)


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
