"""Prefill/decode disaggregation, the gateway's part: while a replica of role prefill serves, a
new request's prompt (longer than --max-local-prefill-tokens) runs there first (max_tokens 1,
greedy), its computed blocks are pinned (ExportKvBlocks), and the request then goes to a decode
replica with `kv_transfer` naming them:
that replica pulls them worker from worker and finds the whole prompt in its prefix cache but
for its last token. The pin is released once the decode replica answered (or after its lease).

Every failure here (no prefill replica, one that dies or is slow, nothing left to export) only
means the decode replica computes the prompt itself; the client sees nothing but latency.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.services.common.engine_api import KVTransferParams
from pagedserve.services.common.errors import PagedServeError, Unavailable
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.gateway.validation import PreparedRequest

if TYPE_CHECKING:  # the transport: passed in, never loaded here
    from pagedserve.services.gateway.replica_set import Replica, ReplicaSet

logger = logging.getLogger(__name__)

PREFILL_SUFFIX = "#prefill"  # the prefill request's id: the request's own, suffixed
_releases: set[asyncio.Task[None]] = set()  # running ReleaseKvBlocks calls


@dataclass(slots=True)
class RemotePrefill:
    replica: Replica
    lease_id: str
    kv_transfer: KVTransferParams
    is_released: bool = field(default=False)

    def release(self) -> None:
        """Once; best effort (the lease expires anyway)."""
        if self.is_released:
            return
        self.is_released = True
        task = asyncio.get_running_loop().create_task(self._release())
        _releases.add(task)
        task.add_done_callback(_releases.discard)

    async def _release(self) -> None:
        try:
            await self.replica.client.release_kv_blocks(self.lease_id)
        except PagedServeError as exc:
            logger.debug("releasing KV lease %s on %s failed: %s", self.lease_id,
                         self.replica.address, exc)


def wants_remote_prefill(request: PreparedRequest, block_size: int,
                         max_local_prefill_tokens: int) -> bool:
    """A prompt longer than max_local_prefill_tokens, with a full block before its last token,
    whose logprobs are not asked for (they need every position computed where it runs)."""
    num_tokens = len(request.prompt_token_ids)
    return (block_size > 0 and num_tokens > max_local_prefill_tokens
            and (num_tokens - 1) // block_size >= 1
            and not request.is_pooling and request.sampling.prompt_logprobs is None)


async def prefill_remotely(replicas: ReplicaSet, request: PreparedRequest, owner: str,
                           timeout_s: float) -> RemotePrefill | None:
    """The prompt computed on a prefill replica and its blocks pinned there; None when no
    prefill replica serves or anything failed."""
    if not wants_remote_prefill(request, replicas.block_size,
                                replicas.config.max_local_prefill_tokens):
        return None
    replica = replicas.choose_prefill(request.prompt_token_ids)
    if replica is None:
        return None
    prefill = PreparedRequest(
        request_id=request.request_id + PREFILL_SUFFIX, prompt_token_ids=request.prompt_token_ids,
        sampling=SamplingParams(temperature=0.0, max_tokens=1), priority=request.priority,
        arrival_s=request.arrival_s)
    try:
        async with asyncio.timeout(timeout_s):
            with replicas.holding(replica):
                await replica.client.submit(prefill, _stay, owner)
                lease_id, kv_transfer = await replica.client.export_kv_blocks(
                    request.prompt_token_ids)
    except (PagedServeError, TimeoutError) as exc:
        logger.warning("request %s: prefill on %s failed (%s); the decode replica computes the "
                       "prompt", request.request_id, replica.address, exc or "timed out")
        if isinstance(exc, Unavailable):
            replicas.mark_failed(replica)
        return None
    if not lease_id:
        return None
    return RemotePrefill(replica, lease_id, kv_transfer)


def _stay(output: object) -> bool:
    """The prefill's single token is not needed: only its blocks are."""
    return False
