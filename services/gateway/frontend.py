"""The gateway's generation path, shared by every front door (gRPC, HTTP): admission, validation,
tokenization, submission to the scheduler, and the request's text deltas. No transport here: each
front door converts its wire format to a GenerateInput and the StreamDeltas back.

The gateway keeps nothing that must survive it: the count of its live requests (for admission
and draining) is all. Leaving `generate` early — a stop string ends every output, the client
cancels, its deadline passes — cancels the Submit call, which aborts the request in the scheduler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator

from pagedserve.services.common.errors import (
    InvalidRequest,
    Overloaded,
    PagedServeError,
    Unavailable,
)
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.gateway.scheduler_client import SchedulerClient
from pagedserve.services.gateway.validation import (
    GenerateInput,
    ModelInfo,
    PreparedRequest,
    prepare_request,
    prompt_token_ids,
)
from pagedserve.services.text.text_stream import StreamDelta, TextStream
from pagedserve.services.text.tokenizer import Tokenizer


class Admission:
    """Live requests of this gateway: refuses over the limit (RESOURCE_EXHAUSTED) and while
    draining (UNAVAILABLE); `wait_idle` is what a drain waits on."""

    def __init__(self, max_concurrent_requests: int) -> None:
        self._max_live = max_concurrent_requests
        self._num_live = 0
        self._is_draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self._is_draining:
            raise Unavailable("the gateway is shutting down; retry on another replica")
        if self._num_live >= self._max_live:
            raise Overloaded(f"{self._num_live} requests in flight, the limit "
                             f"(max_concurrent_requests) is {self._max_live}")
        self._num_live += 1
        self._idle.clear()
        try:
            yield
        finally:
            self._num_live -= 1
            if self._num_live == 0:
                self._idle.set()

    def start_draining(self) -> None:
        self._is_draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()


class Frontend:
    def __init__(self, tokenizer: Tokenizer, scheduler: SchedulerClient, model_info: ModelInfo,
                 admission: Admission, metrics: GatewayMetrics | None = None) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.info = model_info
        self.admission = admission
        self.metrics = metrics

    def prepare(self, request: GenerateInput) -> PreparedRequest:
        return prepare_request(request, self.tokenizer, self.info)

    def tokenize(self, request: GenerateInput) -> list[int]:
        return prompt_token_ids(request, self.tokenizer, self.info)

    async def abort(self, request_id: str) -> None:
        """Forwarded to the scheduler, so any gateway replica can abort any request; the
        request's own stream then ends with finish_reason "abort"."""
        if not request_id:
            raise InvalidRequest("request_id must not be empty, got ''")
        await self.scheduler.abort(request_id)

    async def generate(self, request: PreparedRequest) -> AsyncIterator[StreamDelta]:
        """The request's text deltas until every output has finished. A request the scheduler
        ends early raises Unavailable; outputs that failed raise PagedServeError at the end."""
        text_stream = TextStream(request.prompt_token_ids, request.sampling, self.tokenizer)
        timer = None if self.metrics is None else self.metrics.start_request()
        outputs = self.scheduler.submit(request)
        errors: list[str] = []
        usage = None
        try:
            async for output in outputs:
                if timer is not None and any(o.token_ids for o in output.outputs):
                    timer.on_tokens()
                for delta in text_stream.on_output(output):
                    if delta.error:
                        errors.append(f"output {delta.index}: {delta.error}")
                    usage = delta.usage or usage
                    yield delta
                if text_stream.is_finished:
                    break  # a stop string ended the last output: closing aborts the rest
        finally:
            await outputs.aclose()
        if not text_stream.is_finished:
            raise Unavailable(f"the scheduler ended request {request.request_id!r} before "
                              "every output finished")
        if timer is not None:
            timer.finished(usage)
        if errors:
            raise PagedServeError(f"request {request.request_id!r} failed: {'; '.join(errors)}")
