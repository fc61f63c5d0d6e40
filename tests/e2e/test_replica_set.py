"""Who the gateway's replica set lets serve: a replica serving another model than the first one
is left out (and says why in the log); replicas found as the IP addresses a name resolved to are
reached over mutual TLS by that name, whose certificates carry no IP."""

from __future__ import annotations

import logging
import time

import grpc
import pytest
from pagedserve.services.common.config import TlsConfig
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.tls import internal_channel
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from pagedserve.certificates import write_certificates
from tests.e2e.replica_stack import Replica, start_replica_stack
from tests.e2e.stack import tiny_config

SERVER_NAME = "replicas.test"


def generate(address: str, i: int) -> list[int]:
    with grpc.insecure_channel(address) as channel:
        response = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(gateway_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(token_ids=[3 + i, 5, 7, 11]),
            sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)),
            timeout=120)
    return list(response.outputs[0].token_ids)


def generation_tokens(replica: Replica) -> int:
    return replica.scheduler[1].engine.core.totals().num_generation_tokens


def test_a_replica_serving_another_model_is_refused_and_logged(
        tiny_served_model_dir, tiny_odd_vocab_model_dir, caplog):
    caplog.set_level(logging.ERROR)
    stack = start_replica_stack(tiny_config(tiny_served_model_dir), 1,
                                routing=RoutingConfig(routing_policy="round-robin",
                                                      replica_refresh_s=0.2))
    try:
        other = stack.add_replica(tiny_config(tiny_odd_vocab_model_dir))
        stack.refresh()
        deadline = time.monotonic() + 60
        while not any("serves another model" in r.getMessage() for r in caplog.records):
            assert time.monotonic() < deadline, "the other model's replica was never refused"
            time.sleep(0.05)
        message = next(r.getMessage() for r in caplog.records
                       if "serves another model" in r.getMessage())
        assert other.address in message and "vocab_size=510" in message, message
        assert [r.address for r in stack.gateway.replicas.serving()] == [
            stack.replicas[0].address]
        for i in range(4):
            assert len(generate(stack.gateway_address, i)) == 4
        assert generation_tokens(other) == 0
        assert generation_tokens(stack.replicas[0]) >= 16
    finally:
        stack.close()


@pytest.fixture
def name_only_certificates(tmp_path):
    """Certificates whose only name is SERVER_NAME: no IP address, no localhost."""
    write_certificates(tmp_path, ("worker", "scheduler", "gateway"), (SERVER_NAME,))
    return {"worker": TlsConfig(internal_tls_dir=str(tmp_path / "worker")),
            "scheduler": TlsConfig(internal_tls_dir=str(tmp_path / "scheduler"),
                                   tls_server_name=SERVER_NAME),
            "gateway": TlsConfig(internal_tls_dir=str(tmp_path / "gateway"))}


def test_replicas_resolved_to_ips_are_verified_by_the_name(tiny_served_model_dir,
                                                          name_only_certificates):
    stack = start_replica_stack(tiny_config(tiny_served_model_dir), 2,
                                tls=name_only_certificates, server_name=SERVER_NAME,
                                routing=RoutingConfig(routing_policy="round-robin"))
    try:
        deadline = time.monotonic() + 60
        while len(stack.gateway.replicas.serving()) < 2:
            assert time.monotonic() < deadline, "a replica never served over TLS"
            time.sleep(0.05)
        assert all(r.address.startswith("127.0.0.1:") for r in stack.replicas)
        outputs = [generate(stack.gateway_address, 0) for _ in range(4)]
        assert all(out == outputs[0] and len(out) == 4 for out in outputs)
        assert all(generation_tokens(r) >= 8 for r in stack.replicas)
        # the same TLS dialling the IP, with no name to verify instead, is refused
        gateway_tls = name_only_certificates["gateway"]
        with internal_channel(stack.replicas[0].address, gateway_tls) as channel, \
                pytest.raises(grpc.RpcError) as info:
            scheduler_pb2_grpc.SchedulerServiceStub(channel).GetLoad(scheduler_pb2.GetLoadRequest(),
                                                              timeout=10)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        stack.close()
