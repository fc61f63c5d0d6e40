"""Prefill/decode disaggregation through a stack: a prefill replica computes the prompt, the
decode replica's worker pulls its blocks and the decode replica finds the prompt in its prefix
cache; greedy outputs equal a colocated replica's. A transfer that fails, or a prefill replica
that dies, only means the decode replica computes the prompt itself."""

from __future__ import annotations

import time

import grpc
import pytest
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from pagedserve.certificates import ThrowAwayCertificates
from tests.e2e.replica_stack import ReplicaStack, start_replica_stack
from tests.e2e.stack import tiny_config

BLOCK = 16
PROMPTS = [[(37 * j + 11 * i) % 400 + 3 for j in range(n)] for i, n in enumerate((40, 64, 85))]


def generate(stack: ReplicaStack, token_ids: list[int]) -> tuple[list[int], int]:
    """The greedy output's ids and the prompt's cached tokens."""
    with grpc.insecure_channel(stack.gateway_address) as channel:
        response = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(
            gateway_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(token_ids=token_ids),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=8,
                                                   ignore_eos=True)), timeout=120)
    return list(response.outputs[0].token_ids), response.usage.cached_tokens


def route_to(stack: ReplicaStack, *replicas) -> None:
    """Only these replicas are resolved, and the gateway serves with each of them."""
    stack.resolved[:] = [r.address for r in replicas]
    stack.refresh()
    deadline = time.monotonic() + 60
    while {r.address for r in stack.gateway.replicas.serving()} != set(stack.resolved):
        assert time.monotonic() < deadline, "the gateway never served with the listed replicas"
        time.sleep(0.05)


def wait_idle(replica, timeout_s: float = 10.0) -> None:
    """No block held: leases released, requests ended."""
    deadline = time.monotonic() + timeout_s
    while (load := replica.load()).num_gpu_blocks_used or load.num_running_requests:
        assert time.monotonic() < deadline, f"{replica.address} still holds {load}"
        time.sleep(0.05)


@pytest.fixture
def stack(tiny_served_model_dir):
    """Replicas: colocated, prefill, decode, and a prefill replica whose workers cannot be
    reached at the address it names for transfers."""
    config = tiny_config(tiny_served_model_dir)
    config.cache.enable_prefix_caching = True
    stack = start_replica_stack(
        config, 4, replica_kw=[{}, {"role": "prefill"}, {"role": "decode"},
                               {"role": "prefill", "kv_transfer_addresses": ["127.0.0.1:1"],
                                "kv_transfer_timeout_s": 5.0}],
        routing=RoutingConfig(failover_timeout_s=30.0, max_local_prefill_tokens=0))
    yield stack
    stack.close()


def test_disaggregated_greedy_outputs_equal_a_colocated_replica_and_a_failed_transfer_falls_back(
        stack: ReplicaStack):
    colocated, prefill, decode, unreachable = stack.replicas
    transfers = []
    decode.scheduler[1].kv_transfers.on_transfer.append(transfers.append)
    route_to(stack, colocated)
    expected = [generate(stack, p) for p in PROMPTS]
    assert all(num_cached == 0 for _, num_cached in expected)

    route_to(stack, prefill, decode)
    for prompt, (tokens, _) in zip(PROMPTS, expected, strict=True):
        got, num_cached = generate(stack, prompt)
        assert got == tokens
        assert num_cached == (len(prompt) - 1) // BLOCK * BLOCK  # pulled: all but the last token
    assert [(t.is_ok, t.num_blocks) for t in transfers] == [
        (True, (len(p) - 1) // BLOCK) for p in PROMPTS]
    assert all(t.num_bytes > 0 for t in transfers)
    wait_idle(prefill)
    wait_idle(decode)

    route_to(stack, unreachable, decode)
    other = [p[::-1] for p in PROMPTS]
    route_to(stack, colocated)
    expected_other = [generate(stack, p) for p in other]
    route_to(stack, unreachable, decode)
    for prompt, (tokens, _) in zip(other, expected_other, strict=True):
        got, num_cached = generate(stack, prompt)
        assert got == tokens
        assert num_cached == 0  # the pull failed: computed on the decode replica
    assert [t.is_ok for t in transfers[len(PROMPTS):]] == [False] * len(other)
    wait_idle(unreachable)
    wait_idle(decode)


def test_a_request_completes_when_its_prefill_replica_was_killed(stack: ReplicaStack):
    colocated, prefill, decode, _ = stack.replicas
    route_to(stack, colocated)
    prompt = [t + 1 for t in PROMPTS[1]]
    expected, _ = generate(stack, prompt)
    route_to(stack, prefill, decode)
    stack.kill(prefill)  # the gateway may not know yet: its prefill then fails
    got, _ = generate(stack, prompt)
    assert got == expected
    wait_idle(decode)


def test_blocks_travel_between_workers_under_internal_tls(tiny_served_model_dir):
    """Worker to worker with the workers' own certificates (role worker), as `serve` runs it."""
    certificates = ThrowAwayCertificates(("gateway", "scheduler", "worker"))
    config = tiny_config(tiny_served_model_dir)
    config.cache.enable_prefix_caching = True
    stack = start_replica_stack(
        config, 2, tls={role: certificates.tls(role) for role in ("gateway", "scheduler",
                                                                 "worker")},
        replica_kw=[{"role": "prefill"}, {"role": "decode"}],
        routing=RoutingConfig(failover_timeout_s=30.0, max_local_prefill_tokens=0))
    try:
        prefill, decode = stack.replicas
        transfers = []
        decode.scheduler[1].kv_transfers.on_transfer.append(transfers.append)
        deadline = time.monotonic() + 60
        while len(stack.gateway.replicas.serving()) < 2:
            assert time.monotonic() < deadline, "the gateway never served with both replicas"
            time.sleep(0.05)
        _, num_cached = generate(stack, PROMPTS[2])
        assert num_cached == (len(PROMPTS[2]) - 1) // BLOCK * BLOCK
        assert [t.is_ok for t in transfers] == [True]
    finally:
        stack.close()
        certificates.remove()
