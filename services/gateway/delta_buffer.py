"""One request's text deltas between the scheduler's stream and a client that reads at its own
pace, so a slow client never holds back the engine. Past its bound the pending deltas are
coalesced into one per output index: a slow reader gets the same text in fewer, larger pieces.
It counts the tokens it holds, so the request can be paused while its reader is behind.
A reader that is merely behind gets what has piled up in one piece per index each time it reads.
With a stream interval of k, deltas are held until they carry k tokens (an output's first delta,
its last and an error go at once): one message per k tokens costs the gateway and the client
about 1/k of the per-message work.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from pagedserve.services.text.text_stream import TextDelta

MIN_PENDING_DELTAS = 64


def merge_into(first: TextDelta, later: TextDelta) -> None:
    assert first.index == later.index, (first.index, later.index)
    first.text += later.text
    first.token_ids += later.token_ids
    first.logprobs += later.logprobs
    first.top_logprobs += later.top_logprobs
    first.finish_reason = later.finish_reason or first.finish_reason
    first.cumulative_logprob = later.cumulative_logprob
    first.error = later.error or first.error
    first.usage = later.usage or first.usage
    if first.prompt_logprobs is None:
        first.prompt_logprobs = later.prompt_logprobs


class DeltaBuffer:
    """Producer: `put`, then `close` (with the error that ended the stream, if any). Consumer:
    `get` until it returns None. Not thread-safe: one event loop."""

    def __init__(self, num_outputs: int, stream_interval: int = 1) -> None:
        assert stream_interval >= 1, stream_interval
        self._pending: deque[TextDelta] = deque()
        self.stream_interval = stream_interval
        self._started: set[int] = set()  # outputs whose first delta was put
        self.max_pending = max(MIN_PENDING_DELTAS, 2 * num_outputs)
        self._is_ready = False  # the consumer may take: a delta past the interval, or the end
        self._ready_waiter: asyncio.Future[None] | None = None  # the consumer, asleep
        self._is_consumer_away = asyncio.Event()  # it took a delta and has not asked again
        self._away_since: float | None = None  # time.monotonic() of that take
        self._is_closed = False
        self._error: BaseException | None = None
        self.num_unread_tokens = 0
        # what wait_unread waits for: checked on every count, so its task wakes only once it holds
        self._unread_waiter: tuple[Callable[[int], bool], asyncio.Future[None]] | None = None

    def __len__(self) -> int:
        return len(self._pending)

    def put(self, delta: TextDelta) -> None:
        assert not self._is_closed, "put after close"
        if len(self._pending) >= self.max_pending:
            self._coalesce()
        self._pending.append(delta)
        self._count(len(delta.token_ids))
        if self.stream_interval == 1 or not self._is_held(delta):
            self._set_ready()
        self._started.add(delta.index)

    def _is_held(self, delta: TextDelta) -> bool:
        """Whether the consumer is left asleep: the stream interval is not reached yet."""
        return (self.stream_interval > 1 and self.num_unread_tokens < self.stream_interval
                and delta.index in self._started and not delta.finish_reason and not delta.error)

    def close(self, error: BaseException | None = None) -> None:
        """`get` raises `error` once the pending ones are taken."""
        self._is_closed = True
        self._error = error
        self._set_ready()

    def _set_ready(self) -> None:
        """A future the consumer alone waits on: lighter than an asyncio.Event per delta."""
        self._is_ready = True
        waiter = self._ready_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def get(self) -> TextDelta | None:
        self._away_since = None
        while not self._is_ready:
            self._ready_waiter = asyncio.get_running_loop().create_future()
            await self._ready_waiter
        if self._pending:
            delta = self._take()
            self._count(-len(delta.token_ids))
            if not self._pending and not self._is_closed:
                self._is_ready = False
            self._away_since = time.monotonic()
            self._is_consumer_away.set()
            return delta
        if self._error is not None:
            raise self._error
        return None

    async def wait_unread(self, predicate: Callable[[int], bool]) -> None:
        """Returns once `predicate(num_unread_tokens)` holds; one waiter at a time."""
        if predicate(self.num_unread_tokens):
            return
        waiter = asyncio.get_running_loop().create_future()
        self._unread_waiter = (predicate, waiter)
        try:
            await waiter
        finally:
            self._unread_waiter = None

    def _count(self, num_tokens: int) -> None:
        if num_tokens:
            self.num_unread_tokens += num_tokens
            unread_waiter = self._unread_waiter
            if unread_waiter is not None and unread_waiter[0](self.num_unread_tokens):
                waiter = unread_waiter[1]
                if not waiter.done():
                    waiter.set_result(None)

    async def wait_stalled(self, timeout_s: float) -> None:
        """Returns once the consumer has stayed away `timeout_s` after taking a delta: a front
        door is away while it writes the delta, and a write that long means the client stopped
        reading. It wakes about once per `timeout_s`, not once per delta."""
        while True:
            if self._away_since is None:
                self._is_consumer_away.clear()
                await self._is_consumer_away.wait()
                continue
            remaining_s = self._away_since + timeout_s - time.monotonic()
            if remaining_s <= 0:
                return
            await asyncio.sleep(remaining_s)

    def _take(self) -> TextDelta:
        """The first pending delta with the ones of the same index right behind it."""
        delta = self._pending.popleft()
        while self._pending and self._pending[0].index == delta.index:
            merge_into(delta, self._pending.popleft())
        return delta

    def _coalesce(self) -> None:
        merged: dict[int, TextDelta] = {}
        for delta in self._pending:
            if delta.index in merged:
                merge_into(merged[delta.index], delta)
            else:
                merged[delta.index] = delta
        self._pending = deque(merged.values())
