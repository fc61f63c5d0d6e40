"""Two engine replicas behind one gateway: a replica lost mid-stream costs no stream anything
(each continues on the survivor, token-identical to a run without the fault), replicas join and
leave without a restart, and requests sharing a long prefix meet their cached blocks."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.replica_stack import Replica, ReplicaStack, start_replica_stack
from tests.e2e.stack import tiny_config

NUM_STREAMS = 16
MAX_TOKENS = 96


def sampling(i: int) -> common_pb2.SamplingParams:
    """Greedy, seeded, seeded with penalties, and seeded n=2, in turn."""
    kind = i % 4
    if kind == 0:
        return common_pb2.SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    params = common_pb2.SamplingParams(temperature=1.0, seed=100 + i, max_tokens=MAX_TOKENS,
                                       ignore_eos=True)
    if kind == 2:
        params.repetition_penalty = 1.2
        params.min_tokens = 10
    if kind == 3:
        params.n = 2
    return params


def prompt(i: int, prefix: list[int] | None = None) -> list[int]:
    return [*(prefix or []), *((7 * i + 13 * j) % 300 + 3 for j in range(9 + i % 5))]


def stream(address: str, request: gateway_pb2.GenerateRequest,
           first: threading.Semaphore | None = None) -> dict[int, list[int]]:
    outputs: dict[int, list[int]] = {}
    with grpc.insecure_channel(address) as channel:
        for delta in gateway_pb2_grpc.GenerationServiceStub(channel).GenerateStream(request,
                                                                             timeout=300):
            if first is not None and not outputs:
                first.release()
            outputs.setdefault(delta.index, []).extend(delta.token_ids)
    return outputs


def requests(tag: str) -> list[gateway_pb2.GenerateRequest]:
    return [gateway_pb2.GenerateRequest(request_id=f"{tag}-{i}", sampling=sampling(i),
                                        token_ids=common_pb2.TokenIds(token_ids=prompt(i)))
            for i in range(NUM_STREAMS)]


def wait_idle(replica: Replica, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while True:
        load = replica.load()
        if (load.num_gpu_blocks_used, load.num_running_requests,
                load.num_waiting_requests) == (0, 0, 0):
            return load
        assert time.monotonic() < deadline, f"blocks or requests still held: {load}"
        time.sleep(0.05)


def generation_tokens(replica: Replica) -> int:
    return replica.scheduler[1].engine.core.totals().num_generation_tokens


@pytest.fixture
def stack(tiny_served_model_dir):
    config = tiny_config(tiny_served_model_dir)
    config.cache.enable_prefix_caching = True
    stack = start_replica_stack(config, 2,
                                routing=RoutingConfig(failover_timeout_s=60.0))
    yield stack
    stack.close()


def test_a_replica_killed_under_16_streams_costs_no_stream_a_token(stack: ReplicaStack):
    address = stack.gateway_address
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        expected = list(pool.map(lambda r: stream(address, r), requests("ref")))
        assert [len(out) for out in expected] == [r.sampling.n or 1 for r in requests("x")]
        first = threading.Semaphore(0)
        futures = [pool.submit(stream, address, r, first) for r in requests("run")]
        for _ in range(NUM_STREAMS):
            assert first.acquire(timeout=120)
        victim = max(stack.replicas, key=lambda r: r.load().num_running_requests)
        assert victim.load().num_running_requests > 0
        stack.kill(victim)
        got = [f.result(timeout=300) for f in futures]
    for i, (out, ref) in enumerate(zip(got, expected, strict=True)):
        assert out == ref, f"stream {i} differs"
        assert all(len(tokens) == MAX_TOKENS for tokens in out.values())
    survivor = next(r for r in stack.replicas if r is not victim)
    load = wait_idle(survivor)
    assert load.num_gpu_blocks_used == 0


def test_replicas_join_and_leave_without_a_restart(stack: ReplicaStack):
    stack.gateway.replicas.router.policy = "round-robin"
    first, second = stack.replicas
    stack.unlist(second)
    stack.refresh()
    before = generation_tokens(second)
    for i in range(4):
        stream(stack.gateway_address, requests("a")[4 * (i % 4)])
    assert generation_tokens(second) == before  # gone from the resolution: no traffic

    third = stack.add_replica()
    stack.refresh()
    deadline = time.monotonic() + 60
    while len(stack.gateway.replicas.serving()) < 2:
        assert time.monotonic() < deadline, "the added replica never served"
        time.sleep(0.05)
    for i in range(4):
        stream(stack.gateway_address, requests("b")[4 * i])
    assert generation_tokens(third) > 0
    assert generation_tokens(second) == before
    assert generation_tokens(first) > 0


def test_requests_sharing_a_long_prefix_meet_their_cached_blocks(stack: ReplicaStack):
    shared = [(31 * j) % 300 + 3 for j in range(80)]  # 5 full blocks of 16
    cached = []
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        for i in range(6):
            response = stub.Generate(gateway_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(token_ids=prompt(i, shared)),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4)), timeout=120)
            cached.append(response.usage.cached_tokens)
    assert cached[0] == 0
    assert all(c >= 64 for c in cached[1:]), cached
    hits = [r.scheduler[1].engine.core.totals().num_prefix_cache_hits for r in stack.replicas]
    assert sorted(hits)[0] == 0 and sorted(hits)[1] >= 5 * 64, hits


def test_watch_load_pushes_each_change(stack: ReplicaStack):
    replica, other = stack.replicas
    stack.unlist(other)
    stack.refresh()
    with grpc.insecure_channel(replica.address) as channel:
        loads = scheduler_pb2_grpc.SchedulerServiceStub(channel).WatchLoad(
            scheduler_pb2.WatchLoadRequest(min_interval_ms=10), timeout=120)
        assert next(loads).num_running_requests == 0
        with ThreadPoolExecutor(1) as pool:
            done = pool.submit(stream, stack.gateway_address, requests("w")[0])
            seen = []
            for load in loads:
                seen.append(load.num_running_requests + load.num_waiting_requests)
                if seen[-1] == 0:
                    break
            assert len(done.result(timeout=120)[0]) == MAX_TOKENS
        loads.cancel()
    assert seen[0] >= 1, seen
