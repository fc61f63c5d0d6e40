"""One request's scheduler events across replicas: routed to one, and when its stream breaks
(the replica died, restarted or is draining: UNAVAILABLE), resubmitted -- to another serving
replica, or the same one once it serves again, within failover_timeout_s -- with the same
request id and the tokens each unfinished output already produced as `resumed_outputs`. The
scheduler continues each of them exactly where it stopped (same seeds, penalties, min_tokens
and max_tokens), so the events after a failover carry only new tokens.

Beam search and best_of > n report their outputs only when they end: one that broke before is
submitted again from its prompt; after (only a partial final event could be lost) it fails. A
request is resubmitted at most MAX_FAILOVERS times.

Backpressure follows the request: `set_paused` pauses or resumes it on the replica that runs it
now, and a request paused when it moves is paused again on its new replica at its first event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from pagedserve.services.common.engine_api import PauseRequest, ResumedOutput
from pagedserve.services.common.errors import PagedServeError, Reason, Unavailable
from pagedserve.services.common.outputs import RequestOutput
from pagedserve.services.gateway.disaggregation import prefill_remotely
from pagedserve.services.gateway.validation import PreparedRequest

if TYPE_CHECKING:  # the transport: passed in, never loaded here
    from pagedserve.services.gateway.metrics import GatewayMetrics
    from pagedserve.services.gateway.replica_set import Replica, ReplicaSet

logger = logging.getLogger(__name__)

MAX_FAILOVERS = 3
PAUSE_RETRY_S = 0.05  # doubled up to 1 s while the replica is unavailable


class ResumableSubmission:
    """`is_stopped(index)`: the gateway ended that output itself (a stop string); it is not
    resumed."""

    def __init__(self, replicas: ReplicaSet, request: PreparedRequest, owner: str,
                 failover_timeout_s: float, is_stopped: Callable[[int], bool],
                 metrics: GatewayMetrics | None = None) -> None:
        self._replicas = replicas
        self._request = request
        self._owner = owner
        self._timeout_s = failover_timeout_s
        self._is_stopped = is_stopped
        self._metrics = metrics
        n = request.sampling.n
        self._token_ids: list[list[int]] = [[] for _ in range(n)]
        self._is_finished = [False] * n
        self._logprob_base = [0.0] * n  # a resumed output's cumulative logprob restarts at 0
        self._cumulative_logprob = [0.0] * n
        self.num_failovers = 0
        self.is_paused = False  # what its consumer wants
        self._replica: Replica | None = None  # the one known to hold the request now
        self._is_paused_there = False
        self._pausing = asyncio.Lock()  # one Pause/Resume at a time, so they arrive in order
        self._syncing: asyncio.Task[None] | None = None  # the pause sync a move started

    async def run(self, on_output: Callable[[RequestOutput], bool]) -> None:
        """Hands each output to `on_output` (in the scheduler call's reader, so it must not
        block; True leaves the request) until the request ends. `remote`, the prompt's blocks
        on a prefill replica, serves the first submission."""
        remote = await prefill_remotely(self._replicas, self._request, self._owner,
                                        self._timeout_s)
        try:
            avoid: set[str] = set()
            while True:
                resumed = self._resumed_outputs()
                replica, decision = await self._replicas.choose(
                    self._request.prompt_token_ids, avoid, self._timeout_s, self.num_failovers)
                if self._metrics is not None:
                    self._metrics.on_routed(decision.address, decision.reason)
                kv_transfer = None
                if remote is not None and not self.num_failovers:
                    kv_transfer = remote.kv_transfer

                def on_event(output: RequestOutput, replica: Replica = replica) -> bool:
                    if remote is not None:
                        remote.release()  # pulled: the decode replica answered
                    if self._replica is not replica:
                        self._replica, self._is_paused_there = replica, False
                        self._start_sync_paused()
                    return on_output(self._observed(output))

                try:
                    with self._replicas.holding(replica):
                        await replica.client.submit(self._request, on_event, self._owner,
                                                    resumed, kv_transfer)
                    return
                except Unavailable as exc:
                    error = exc
                self._replica = None
                self._replicas.mark_failed(replica)
                if self._metrics is not None:
                    self._metrics.on_failover(replica.address)
                self.num_failovers += 1
                if self.num_failovers > MAX_FAILOVERS:
                    raise Unavailable(
                        f"request {self._request.request_id!r} failed over {MAX_FAILOVERS} "
                        f"times; the last replica, {replica.address}, failed with: {error}",
                        reason=Reason.SCHEDULER_UNAVAILABLE,
                        retry_after_s=self._replicas.retry_after_s) from error
                logger.warning("request %s: replica %s failed (%s); failing over (%d of %d)",
                               self._request.request_id, replica.address, error,
                               self.num_failovers, MAX_FAILOVERS)
                avoid = {replica.address}
        finally:
            if remote is not None:
                remote.release()
            if self._syncing is not None:
                self._syncing.cancel()

    async def outputs(self) -> AsyncIterator[RequestOutput]:
        """The outputs as an iterator, for callers off the streaming path (embeddings)."""
        queue: asyncio.Queue[RequestOutput | None] = asyncio.Queue()

        def on_output(output: RequestOutput) -> bool:
            queue.put_nowait(output)
            return False

        async def run() -> None:
            try:
                await self.run(on_output)
            finally:
                queue.put_nowait(None)

        task = asyncio.create_task(run())
        try:
            while (output := await queue.get()) is not None:
                yield output
            await task
        finally:
            task.cancel()

    def _start_sync_paused(self) -> None:
        """A request paused when it moves is paused again on its new replica (a task: this runs
        in the call's reader)."""
        if self.is_paused:
            self._syncing = asyncio.create_task(self._sync_paused())

    def finish_sequence(self, index: int) -> None:
        """A stop string ended output `index`: it ends on the replica that runs it (a move to
        another does not resume it: `is_stopped`)."""
        if self._replica is not None:
            self._replica.client.finish_sequence(self._request.request_id, index)

    async def set_paused(self, is_paused: bool) -> None:
        """Best effort: a request that ended (or failed over) meanwhile stays as it is."""
        self.is_paused = is_paused
        await self._sync_paused()

    async def _sync_paused(self) -> None:
        """A replica that is unavailable for a moment is asked again (a resume that never
        arrived would leave the request stuck), while the request runs there."""
        async with self._pausing:
            replica = self._replica
            delay_s = PAUSE_RETRY_S
            while replica is self._replica and self._is_paused_there != self.is_paused:
                is_paused = self.is_paused
                try:
                    await replica.client.set_paused(PauseRequest(
                        self._request.request_id, self._owner, is_paused))
                except Unavailable:
                    await asyncio.sleep(delay_s)
                    delay_s = min(2 * delay_s, 1.0)
                    continue
                except PagedServeError as exc:  # it ended there, or an older scheduler
                    logger.debug("request %s: %s on %s failed: %s", self._request.request_id,
                                 "pause" if is_paused else "resume", replica.address, exc)
                self._is_paused_there = is_paused

    def _observed(self, output: RequestOutput) -> RequestOutput:
        """In place: the client made `output` for this call alone."""
        token_ids = self._token_ids
        for completion in output.outputs:
            i = completion.index
            if 0 <= i < len(token_ids):
                token_ids[i].extend(completion.token_ids)
                if completion.finish_reason is not None:
                    self._is_finished[i] = True
                total = self._logprob_base[i] + completion.cumulative_logprob
                self._cumulative_logprob[i] = total
                completion.cumulative_logprob = total
        num_prompt_tokens = len(self._request.prompt_token_ids)
        if output.num_cached_tokens > num_prompt_tokens:
            output.num_cached_tokens = num_prompt_tokens
        return output

    def _resumed_outputs(self) -> list[ResumedOutput]:
        """What a (re)submission carries: nothing the first time or when nothing was streamed
        yet, else every unfinished output's tokens. Raises Unavailable when they cannot be."""
        if not any(self._token_ids):
            return []
        sampling = self._request.sampling
        if sampling.use_beam_search or sampling.num_candidates != sampling.n:
            raise Unavailable(
                f"request {self._request.request_id!r} lost its replica after its outputs "
                "were sent; beam search and best_of > n outputs are final only at the end, so "
                "they cannot be resumed", reason=Reason.SCHEDULER_UNAVAILABLE,
                retry_after_s=self._replicas.retry_after_s)
        unfinished = [i for i in range(sampling.n)
                      if not self._is_finished[i] and not self._is_stopped(i)]
        if not unfinished or any(not self._token_ids[i] for i in unfinished):
            raise Unavailable(f"request {self._request.request_id!r} lost its replica before "
                              "every output had a token; it cannot be resumed",
                              reason=Reason.SCHEDULER_UNAVAILABLE,
                              retry_after_s=self._replicas.retry_after_s)
        self._logprob_base = list(self._cumulative_logprob)
        return [ResumedOutput(i, list(self._token_ids[i])) for i in unfinished]
