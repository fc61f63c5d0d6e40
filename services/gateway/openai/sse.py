"""Server-sent events: `data: <json>` lines ending with `data: [DONE]`, and the response that
streams them. A client that goes away, or stops reading, cancels the stream at once (not at the
next write), so its request is aborted down to the worker; closing the response releases what it
held (admission). The connection's send buffers are kept small (connection_guard), so a client
that stops reading blocks the stream's writes, and its backpressure, within a few events."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from json.encoder import encode_basestring  # type: ignore[attr-defined]

from pagedserve.services.gateway.openai.connection_guard import STREAM_WRITER, StreamWriter
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = "data: [DONE]\n\n"
_CHOICES = '"choices":[]'


def event(json_text: str) -> str:
    return f"data: {json_text}\n\n"


class ChunkTemplate:
    """One stream's chunk events, whose fields but one choice are the same in every chunk:
    those are serialized once (from the chunk with no choice), and each event is that text with
    the choice's JSON spliced in. A per-token pydantic model and its dump cost ~10 us; this
    costs a string join."""

    def __init__(self, empty_chunk_json: str) -> None:
        head, choices, tail = empty_chunk_json.partition(_CHOICES)
        assert choices and _CHOICES not in tail, empty_chunk_json
        self._head = f"data: {head}\"choices\":["
        self._tail = f"]{tail}\n\n"

    def event(self, choice_json: str) -> str:
        return self._head + choice_json + self._tail


def json_string(text: str | None) -> str:
    """`text` as a JSON value (null for None), as pydantic writes it: UTF-8, not \\u-escaped."""
    return "null" if text is None else encode_basestring(text)


class EventStreamResponse(StreamingResponse):
    """`stalled`: set when the client stopped reading (the stream is then given up). Under the
    HTTP server (connection_guard) the events go through its StreamWriter, else (an ASGI test
    client) through `send`."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None],
                 stalled: asyncio.Event) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._on_close = on_close
        self._stalled = stalled
        self._writer: StreamWriter | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._writer = scope.get("extensions", {}).get(STREAM_WRITER)
        if self._writer is not None:
            self._writer.limit_send_buffer()
        stream = asyncio.ensure_future(self.stream_response(send))
        disconnect = asyncio.ensure_future(self.listen_for_disconnect(receive))
        stalled = asyncio.ensure_future(self._stalled.wait())
        try:
            await asyncio.wait((stream, disconnect, stalled), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (stream, disconnect, stalled):
                task.cancel()
            results = await asyncio.gather(stream, disconnect, stalled, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self._events.aclose()  # type: ignore[attr-defined]
            self._on_close()
        error = results[0]
        if isinstance(error, Exception) and not isinstance(error, OSError):
            logger.error("event stream failed", exc_info=error)

    async def stream_response(self, send: Send) -> None:
        writer = self._writer
        if writer is None:
            await super().stream_response(send)
            return
        await send({"type": "http.response.start", "status": self.status_code,
                    "headers": self.raw_headers})
        async for event in self._events:
            if writer.must_wait:
                await writer.wait()
            writer.write(event.encode())
        await send({"type": "http.response.body", "body": b"", "more_body": False})
