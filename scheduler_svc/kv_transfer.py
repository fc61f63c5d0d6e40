"""Prefill/decode disaggregation in the scheduler: a prefill replica exports a computed prompt's
blocks (pinned under a lease until released or expired), and a decode replica pulls them into
blocks it reserved, worker from worker, and adopts them into its prefix cache before it queues
the request. Whatever fails on the way (the prefill replica died, evicted the blocks, a worker
timed out, the workers restarted meanwhile) gives the reserved blocks back: the request then
simply misses the prefix cache and computes its prompt here."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from opentelemetry import trace
from pagedserve.scheduler_svc.async_engine import AsyncEngine
from pagedserve.scheduler_svc.block_manager import KvImport
from pagedserve.services.common.engine_api import KVTransferParams

logger = logging.getLogger(__name__)

DEFAULT_LEASE_TTL_S = 30.0
MAX_LEASE_TTL_S = 600.0
TRANSFER_SPAN = "kv_transfer"


class KvPuller(Protocol):
    def pull_kv_blocks(self, source_address: str, src_block_ids: list[int],
                       dst_block_ids: list[int], scheduler_epoch: int, timeout_s: float
                       ) -> int: ...


@dataclass(frozen=True, slots=True)
class TransferStats:
    """One pull, as the metrics see it."""

    duration_s: float
    num_blocks: int
    num_bytes: int  # over every rank
    is_ok: bool


class KvTransfers:
    def __init__(self, engine: AsyncEngine, export_addresses: list[str], timeout_s: float,
                 workers: list[KvPuller] | None = None) -> None:
        """`export_addresses`: this replica's workers as decode replicas reach them;
        `workers`: the pullers by rank (default: the engine's workers)."""
        self._engine = engine
        self._export_addresses = export_addresses
        self._timeout_s = timeout_s
        self._workers: list[KvPuller] = workers if workers is not None else engine.core.workers
        self._leases: dict[str, list[int]] = {}
        self._tracer = trace.get_tracer(__name__)
        self.on_transfer: list[Callable[[TransferStats], None]] = []

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    async def export(self, prompt_token_ids: list[int], lease_ttl_s: float = 0.0
                     ) -> tuple[str, KVTransferParams]:
        """Pins what the prefix cache holds of the prompt; ("", no blocks) when nothing."""
        block_manager = self._engine.core.block_manager
        block_ids = await self._engine.call(lambda: block_manager.pin_prefix(prompt_token_ids))
        if not block_ids:
            return "", KVTransferParams(list(self._export_addresses), [])
        lease_id = uuid.uuid4().hex
        self._leases[lease_id] = block_ids
        ttl_s = min(lease_ttl_s or DEFAULT_LEASE_TTL_S, MAX_LEASE_TTL_S)
        asyncio.get_running_loop().call_later(ttl_s, self.release, lease_id)
        return lease_id, KVTransferParams(list(self._export_addresses), block_ids)

    def release(self, lease_id: str) -> None:
        """Before the next step; an unknown or expired lease is ignored."""
        block_ids = self._leases.pop(lease_id, None)
        if block_ids is not None:
            block_manager = self._engine.core.block_manager
            self._engine.queue(lambda: block_manager.unpin(block_ids))

    async def pull(self, prompt_token_ids: list[int], params: KVTransferParams) -> int:
        """The prompt's blocks this replica lacks, from the prefill replica's workers into its
        prefix cache; the number of blocks copied (0 when none was: they are computed here).
        The adoption is queued before anything the caller queues next."""
        if len(params.worker_addresses) != len(self._workers) or not params.block_ids:
            if params.block_ids:
                logger.warning("no KV transfer: the prefill replica has %d workers, this one %d",
                               len(params.worker_addresses), len(self._workers))
            return 0
        core = self._engine.core

        def reserve() -> tuple[KvImport | None, int]:
            return (core.block_manager.reserve_import(prompt_token_ids, len(params.block_ids)),
                    core.get_load().num_worker_rebuilds)

        reserving = self._engine.call(reserve)
        try:
            kv_import, num_rebuilds = await asyncio.shield(reserving)
        except asyncio.CancelledError:
            reserving.add_done_callback(self._cancel_reserved)
            raise
        if kv_import is None:
            return 0
        first = len(kv_import.held_block_ids)
        src_block_ids = params.block_ids[first:first + len(kv_import.block_ids)]
        with self._tracer.start_as_current_span(TRANSFER_SPAN) as span:
            span.set_attributes({"pagedserve.kv_transfer.num_blocks": len(src_block_ids),
                                 "pagedserve.kv_transfer.source": params.worker_addresses[0]})
            start = time.perf_counter()
            # every rank's pull runs to its end, even when this task is cancelled: the blocks
            # go back only once no worker can still write them
            pulls = asyncio.gather(*(
                asyncio.to_thread(worker.pull_kv_blocks, address, src_block_ids,
                                  kv_import.block_ids, core.scheduler_epoch, self._timeout_s)
                for worker, address in zip(self._workers, params.worker_addresses, strict=True)))
            pulls.add_done_callback(lambda done: self._finish(done, kv_import, num_rebuilds))
            try:
                num_bytes = sum(await asyncio.shield(pulls))
            except Exception as exc:  # noqa: BLE001 - any failure is a local prefill
                span.set_status(trace.Status(trace.StatusCode.ERROR, str(exc)))
                logger.warning("KV transfer of %d blocks from %s failed (computed here "
                               "instead): %s", len(src_block_ids), params.worker_addresses[0], exc)
                self._record(TransferStats(time.perf_counter() - start, 0, 0, False))
                return 0
            span.set_attribute("pagedserve.kv_transfer.num_bytes", num_bytes)
        self._record(TransferStats(time.perf_counter() - start, len(src_block_ids), num_bytes,
                                   True))
        return len(src_block_ids)

    def _cancel_reserved(self, reserving: asyncio.Future) -> None:
        """The caller left while its blocks were reserved."""
        if reserving.cancelled() or reserving.exception() is not None:
            return
        kv_import, _ = reserving.result()
        if kv_import is not None:
            block_manager = self._engine.core.block_manager
            self._engine.queue(lambda: block_manager.cancel_import(kv_import))

    def _finish(self, pulls: asyncio.Future, kv_import: KvImport, num_rebuilds: int) -> None:
        """Adopts the blocks if every rank has them and no worker was rebuilt meanwhile (a
        rebuilt worker's cache lost them); else gives them back. Queued ahead of the request."""
        core = self._engine.core
        is_ok = not pulls.cancelled() and pulls.exception() is None

        def finish() -> None:
            if is_ok and core.get_load().num_worker_rebuilds == num_rebuilds:
                core.block_manager.adopt_import(kv_import)
            else:
                core.block_manager.cancel_import(kv_import)

        self._engine.queue(finish)

    def _record(self, stats: TransferStats) -> None:
        for observer in self.on_transfer:
            observer(stats)
