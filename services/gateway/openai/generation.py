"""One HTTP request's prompts through the Frontend: admitted and prepared up front (so refusals
and bad input answer with their status before any byte is streamed), then their deltas
interleaved as they come. Leaving early closes every prompt's stream, which aborts it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable
from typing import TypeVar

from pagedserve.services.common.errors import Unavailable
from pagedserve.services.gateway.frontend import Frontend
from pagedserve.services.gateway.validation import GenerateInput, PreparedRequest
from pagedserve.services.text.text_stream import StreamDelta
from starlette.requests import Request

T = TypeVar("T")


class Submission:
    """Admitted, prepared prompts; `close` gives their admission back (idempotent)."""

    def __init__(self, frontend: Frontend, inputs: list[GenerateInput]) -> None:
        self._frontend = frontend
        self._admitted = contextlib.ExitStack()
        try:
            self.prepared: list[PreparedRequest] = []
            for request in inputs:
                self._admitted.enter_context(frontend.admission.admit())
                self.prepared.append(frontend.prepare(request))
        except BaseException:
            self._admitted.close()
            raise

    def close(self) -> None:
        self._admitted.close()

    async def deltas(self) -> AsyncGenerator[tuple[int, StreamDelta], None]:
        """(prompt index, delta) until every prompt has finished."""
        if len(self.prepared) == 1:
            async with contextlib.aclosing(self._frontend.generate(self.prepared[0])) as deltas:
                async for delta in deltas:
                    yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, StreamDelta | None, BaseException | None]] = \
            asyncio.Queue()

        async def pump(index: int, request: PreparedRequest) -> None:
            try:
                async with contextlib.aclosing(self._frontend.generate(request)) as deltas:
                    async for delta in deltas:
                        queue.put_nowait((index, delta, None))
            except Exception as exc:
                queue.put_nowait((index, None, exc))
                return
            queue.put_nowait((index, None, None))

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


class StartedDeltas:
    """A submission's deltas once the first one came: a scheduler that is gone or refuses the
    request raises while the HTTP status can still say so, not inside a 200 event stream.
    Close it (`aclose`) to abort what still runs."""

    def __init__(self, first: tuple[int, StreamDelta] | None,
                 rest: AsyncGenerator[tuple[int, StreamDelta], None]) -> None:
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

    async def __anext__(self) -> tuple[int, StreamDelta]:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        return await anext(self._rest)

    async def aclose(self) -> None:
        await self._rest.aclose()


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
