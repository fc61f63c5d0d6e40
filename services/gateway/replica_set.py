"""The scheduler replicas one gateway routes to: found from --scheduler-address (several targets,
and host names resolved to every address they have, IPv4 and IPv6, again every
replica_refresh_s), each with
one SchedulerClient, its health and its load (a WatchLoad stream).

A replica serves (takes new requests) from its first pushed load until that stream breaks or a
request saw it fail; its watcher then waits (Health.Watch) until it serves again. A replica whose
model differs from the first one served never serves. A replica gone from the resolution takes
no new request; its channel closes once its live requests end (or fail over).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass

from pagedserve.services.common.config import TlsConfig
from pagedserve.services.common.engine_api import (
    ROLE_BOTH,
    ROLE_PREFILL,
    AbortRequest,
    EngineLoad,
)
from pagedserve.services.common.errors import NotFound, PagedServeError, Reason, Unavailable
from pagedserve.services.gateway.config import RoutingConfig, scheduler_targets
from pagedserve.services.gateway.routing import Candidate, Decision, Router
from pagedserve.services.gateway.scheduler_client import SCHEDULER_RETRY_AFTER_S, SchedulerClient
from pagedserve.services.rpc.convert_scheduler import role_from_proto
from pagedserve.services.rpc.internal.v1 import scheduler_pb2
from pagedserve.services.rpc.tracing import set_routing_decision

logger = logging.getLogger(__name__)

LOAD_INTERVAL_S = 0.1  # the most often a scheduler pushes its load
RETRY_S = 0.5  # after a watch failed at once (no wait inside it)
_SAME_MODEL_FIELDS = ("model", "architecture", "max_model_len", "vocab_size", "block_size")


@dataclass(slots=True, eq=False)
class Replica:
    address: str
    client: SchedulerClient
    is_serving: bool = False
    is_removed: bool = False
    load: EngineLoad | None = None
    served: scheduler_pb2.GetServedModelResponse | None = None
    num_live: int = 0  # this gateway's requests on it
    watcher: asyncio.Task[None] | None = None
    role: str = ROLE_BOTH  # as its scheduler reports it (--role)

    @property
    def num_requests(self) -> int:
        """Its queue as last pushed, or this gateway's own requests if more (pushes lag)."""
        pushed = 0 if self.load is None else self.load.num_running + self.load.num_waiting
        return max(pushed, self.num_live)


Resolver = Callable[[str], Awaitable[dict[str, str]]]


class ReplicaSet:
    retry_after_s = SCHEDULER_RETRY_AFTER_S  # what a client is told when no replica serves

    def __init__(self, scheduler_address: str, config: RoutingConfig, rpc_timeout_s: float,
                 tls: TlsConfig | None = None, resolve: Resolver | None = None) -> None:
        """`resolve`: target -> {address: server name} (default: DNS, see resolve_target)."""
        self._resolve = resolve or resolve_target
        self.targets = scheduler_targets(scheduler_address)
        self.config = config
        self.router = Router(config.routing_policy, config.routing_max_imbalance,
                             config.routing_prefix_blocks, config.routing_index_blocks,
                             config.routing_kv_events, config.routing_offload_weight)
        # the first replica's: the model
        self.served: scheduler_pb2.GetServedModelResponse | None = None
        self.replicas: dict[str, Replica] = {}
        self._rpc_timeout_s = rpc_timeout_s
        self._tls = tls
        self._resolved: dict[str, dict[str, str]] = {}  # target -> address -> server name
        self._changed = asyncio.Event()  # set, then replaced, when a replica's serving changes
        self._refresher: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()  # channels of removed replicas

    async def start(self) -> None:
        """Resolve the targets and watch every replica; re-resolve every replica_refresh_s."""
        await self.refresh()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="replica-refresh")

    async def wait_until_serving(self) -> scheduler_pb2.GetServedModelResponse:
        """The model of the first replica to serve, once one does."""
        while self.served is None or not self.serving():
            await self._changed.wait()
        return self.served

    def serving(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.is_serving]

    def serving_prefill(self) -> list[Replica]:
        """The serving replicas of role prefill: new requests' prompts go there first."""
        return [r for r in self.serving() if r.role == ROLE_PREFILL]

    @property
    def block_size(self) -> int:
        return self.served.block_size if self.served is not None else 0

    async def refresh(self) -> None:
        for target in self.targets:
            try:
                self._resolved[target] = await self._resolve(target)
            except OSError as exc:  # keep what it resolved to before
                logger.warning("cannot resolve scheduler address %s: %s", target, exc)
        wanted = {a: n for resolved in self._resolved.values() for a, n in resolved.items()}
        for address, server_name in wanted.items():
            if address not in self.replicas:
                self._add(address, server_name)
        for address in [a for a in self.replicas if a not in wanted]:
            self._remove(self.replicas.pop(address))

    async def choose(self, prompt_token_ids: list[int], avoid: set[str], timeout_s: float,
                     num_failovers: int = 0) -> tuple[Replica, Decision]:
        """A serving replica, not one of `avoid` while another serves; waits at most timeout_s
        for one (Unavailable after). The decision goes on the request's span."""
        try:
            async with asyncio.timeout(timeout_s):
                while not (serving := self.serving()):
                    await self._changed.wait()
        except TimeoutError:
            raise Unavailable(f"no scheduler replica of {', '.join(self.targets)} served within "
                              f"failover_timeout_s={timeout_s:g}",
                              reason=Reason.SCHEDULER_UNAVAILABLE,
                              retry_after_s=SCHEDULER_RETRY_AFTER_S) from None
        # prefill replicas take whole requests only while nothing else serves
        serving = [r for r in serving if r.role != ROLE_PREFILL] or serving
        candidates = [r for r in serving if r.address not in avoid] or serving
        return self._choose(candidates, prompt_token_ids, num_failovers)

    def choose_prefill(self, prompt_token_ids: list[int]) -> Replica | None:
        """A serving prefill replica for the prompt (prefix affinity among them, bounded by
        load); None while none serves."""
        candidates = self.serving_prefill()
        return self._choose(candidates, prompt_token_ids, 0)[0] if candidates else None

    def _choose(self, candidates: list[Replica], prompt_token_ids: list[int],
                num_failovers: int) -> tuple[Replica, Decision]:
        decision = self.router.choose(
            [Candidate(r.address, r.num_requests,
                       r.served.num_gpu_blocks if r.served is not None else 0)
             for r in candidates], prompt_token_ids,
            self.block_size)
        set_routing_decision(decision.address, decision.reason, num_failovers)
        return self.replicas[decision.address], decision

    @contextlib.contextmanager
    def holding(self, replica: Replica) -> Iterator[None]:
        """Counts a request on `replica` while it runs there."""
        replica.num_live += 1
        try:
            yield
        finally:
            replica.num_live -= 1
            if replica.is_removed and replica.num_live == 0:
                self._close_later(replica)

    def mark_failed(self, replica: Replica) -> None:
        """A request saw it fail: no new requests until its watcher finds it serving again."""
        if replica.is_removed:
            return
        if replica.watcher is not None:
            replica.watcher.cancel()
        self._set_serving(replica, False)
        replica.watcher = asyncio.create_task(self._watch(replica), name=f"watch {replica.address}")

    async def abort(self, request: AbortRequest) -> None:
        """On every replica (the request runs on one); NotFound if none has it."""
        replicas = [r for r in self.replicas.values() if not r.is_removed]
        results = await asyncio.gather(*(r.client.abort(request) for r in replicas),
                                       return_exceptions=True)
        if any(result is None for result in results):
            return
        for error in results:
            if not isinstance(error, NotFound):
                raise error
        raise NotFound(f"request_id {request.request_id!r} is not running",
                       reason=Reason.REQUEST_NOT_FOUND, field="request_id")

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        for replica in list(self.replicas.values()):
            if replica.watcher is not None:
                replica.watcher.cancel()
            await replica.client.close()
        self.replicas.clear()

    def _add(self, address: str, server_name: str) -> None:
        logger.info("scheduler replica %s added", address)
        replica = Replica(address, SchedulerClient(address, self._rpc_timeout_s, self._tls,
                                                   server_name))
        self.replicas[address] = replica
        replica.watcher = asyncio.create_task(self._watch(replica), name=f"watch {address}")

    def _remove(self, replica: Replica) -> None:
        logger.info("scheduler replica %s removed (%d live requests finish there)",
                    replica.address, replica.num_live)
        replica.is_removed = True
        self.router.kv_index.remove(replica.address)
        if replica.watcher is not None:
            replica.watcher.cancel()
        self._set_serving(replica, False)
        if replica.num_live == 0:
            self._close_later(replica)

    def _close_later(self, replica: Replica) -> None:
        task = asyncio.get_running_loop().create_task(replica.client.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.replica_refresh_s)
            await self.refresh()

    async def _watch(self, replica: Replica) -> None:
        """Serving while its load streams in; otherwise waiting (Health.Watch) to serve again."""
        while True:
            try:
                await replica.client.wait_until_serving()
                served = await replica.client.get_served_model()
                if not self._is_same_model(replica.address, served):
                    await asyncio.sleep(self.config.replica_refresh_s)
                    continue
                replica.served = served
                replica.role = role_from_proto(served)
                kv_events = asyncio.create_task(self._watch_kv_events(replica),
                                                name=f"kv events {replica.address}")
                try:
                    async for load in replica.client.watch_load(LOAD_INTERVAL_S):
                        replica.load = load
                        self._set_serving(replica, True)
                finally:
                    kv_events.cancel()
                    self.router.kv_index.mark_lost(replica.address)
            except PagedServeError as exc:
                logger.info("scheduler replica %s is not serving: %s", replica.address, exc)
            self._set_serving(replica, False)
            await asyncio.sleep(RETRY_S)

    async def _watch_kv_events(self, replica: Replica) -> None:
        """What the replica holds, while its load streams in: resumed after a break, from a
        snapshot when it restarted (the router stops counting its blocks meanwhile)."""
        kv_index = self.router.kv_index
        while True:
            num_batches = 0
            try:
                async for batch in replica.client.watch_kv_events(
                        kv_index.resume_point(replica.address)):
                    kv_index.apply(replica.address, batch)
                    num_batches += 1
            except PagedServeError as exc:
                logger.debug("KV events of scheduler replica %s stopped: %s", replica.address, exc)
            except ValueError as exc:
                logger.warning("KV events of scheduler replica %s dropped: %s", replica.address,
                               exc)
                kv_index.remove(replica.address)
            kv_index.mark_lost(replica.address)
            # a scheduler without the stream (an older version) is asked again only rarely
            await asyncio.sleep(RETRY_S if num_batches else self.config.replica_refresh_s)

    def _is_same_model(self, address: str, served: scheduler_pb2.GetServedModelResponse) -> bool:
        if self.served is None:
            self.served = served
            return True
        different = [f"{name}={getattr(served, name)!r} (not {getattr(self.served, name)!r})"
                     for name in _SAME_MODEL_FIELDS
                     if getattr(served, name) != getattr(self.served, name)]
        if different:
            logger.error("scheduler replica %s serves another model, left out: %s", address,
                         ", ".join(different))
        return not different

    def _set_serving(self, replica: Replica, is_serving: bool) -> None:
        if not is_serving:
            replica.load = None
        if replica.is_serving != is_serving:
            replica.is_serving = is_serving
            logger.info("scheduler replica %s %s", replica.address,
                        "serving" if is_serving else "not serving")
            self._changed.set()
            self._changed = asyncio.Event()


async def resolve_target(target: str) -> dict[str, str]:
    """address -> server name: the target itself when its host is an IP, else what
    replica_addresses makes of the addresses it resolves to."""
    host, _, port = target.rpartition(":")
    bare = host.strip("[]")
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(bare)
        return {target: ""}
    infos = await asyncio.get_running_loop().getaddrinfo(bare, int(port),
                                                         type=socket.SOCK_STREAM)
    return replica_addresses(target, [str(info[4][0]) for info in infos])


def replica_addresses(target: str, ips: list[str]) -> dict[str, str]:
    """One replica per address, IPv4 and IPv6 alike (`[v6]:port`), named by the host for TLS.
    The target stays as it is when it names one host: one address, or one of each family (a
    dual-stack host such as localhost, which gRPC reaches by either)."""
    host, _, port = target.rpartition(":")
    ips = list(dict.fromkeys(ips))
    num_v6 = sum(":" in ip for ip in ips)
    if len(ips) <= 1 or (len(ips) == 2 and num_v6 == 1):
        return {target: ""}
    bare = host.strip("[]")
    return {(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"): bare for ip in ips}
