"""KV events through a stack: a scheduler streams what its prefix cache stores, resumably; the
gateway routes a prompt to the replica that really holds its prefix, even one it never sent
there; and a killed replica is no longer counted."""

from __future__ import annotations

import time

import grpc
import pytest
from pagedserve.services.common.block_hash import hash_prompt_blocks
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.replica_stack import ReplicaStack, start_replica_stack
from tests.e2e.stack import tiny_config

BLOCK = 16


def prefix(i: int) -> list[int]:
    return [(31 * j + 97 * i) % 300 + 3 for j in range(5 * BLOCK)]


def generate(stack: ReplicaStack, token_ids: list[int]) -> int:
    """The prompt's cached tokens."""
    with grpc.insecure_channel(stack.gateway_address) as channel:
        response = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(
            gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=token_ids),
                                        sampling=common_pb2.SamplingParams(temperature=0.0,
                                                                           max_tokens=2)),
            timeout=120)
    return response.usage.cached_tokens


def wait_for(condition, what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.fixture
def stack(tiny_served_model_dir):
    config = tiny_config(tiny_served_model_dir)
    config.cache.enable_prefix_caching = True
    stack = start_replica_stack(config, 2, routing=RoutingConfig(failover_timeout_s=60.0))
    yield stack
    stack.close()


def test_a_scheduler_streams_its_stored_blocks_and_a_reconnect_resumes(stack: ReplicaStack):
    replica, other = stack.replicas
    stack.unlist(other)
    stack.refresh()
    with grpc.insecure_channel(replica.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        events = stub.WatchKvEvents(scheduler_pb2.WatchKvEventsRequest(), timeout=120)
        snapshot = next(events)
        assert snapshot.is_snapshot and snapshot.log_id
        generate(stack, [*prefix(0), 7])
        stored = next(events)
        events.cancel()
        assert not stored.is_snapshot and stored.log_id == snapshot.log_id
        [event] = stored.events
        assert list(event.block_stored.block_hashes) == hash_prompt_blocks(prefix(0), BLOCK, 5)
        assert event.block_stored.num_tokens == 5 * BLOCK
        assert event.block_stored.medium == scheduler_pb2.KV_CACHE_MEDIUM_GPU

        generate(stack, [*prefix(1), 7])
        resumed = stub.WatchKvEvents(scheduler_pb2.WatchKvEventsRequest(
            log_id=stored.log_id, last_sequence=stored.last_sequence), timeout=120)
        batch = next(resumed)
        resumed.cancel()
        assert not batch.is_snapshot
        assert [list(e.block_stored.block_hashes) for e in batch.events] == [
            hash_prompt_blocks(prefix(1), BLOCK, 5)]


def test_the_gateway_routes_to_the_replica_that_holds_the_prefix(stack: ReplicaStack):
    router = stack.gateway.replicas.router
    router.policy = "round-robin"  # places the prefixes without the gateway's history
    for i in range(4):
        assert generate(stack, [*prefix(i), 7]) == 0
    addresses = [r.address for r in stack.replicas]
    wait_for(lambda: sum(router.kv_index.num_held_blocks(a) for a in addresses) == 4 * 5,
             "the gateway never saw the stored blocks")
    router.policy = "affinity"
    replicas = stack.gateway.replicas.replicas.values()
    for i in range(4):
        # the events' holder is taken only where it is no busier than the memory's guess: a
        # load the replicas pushed before the last request ended must not decide the route
        wait_for(lambda: all(r.num_requests == 0 for r in replicas),
                 "a replica's pushed load never came back to idle")
        assert generate(stack, [*prefix(i), 8, 9]) == 5 * BLOCK, f"prefix {i} missed"

    victim = stack.replicas[0]
    stack.kill(victim)
    wait_for(lambda: not router.kv_index.is_live(victim.address),
             "the killed replica's blocks still count")
