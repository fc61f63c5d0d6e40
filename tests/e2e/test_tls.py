"""Mutual TLS inside a real stack (gateway -> scheduler -> worker over loopback gRPC): the
internal ports take only peers with a certificate of the stack's CA, and of the role that calls
them; the public port stays plaintext here and serves as before."""

import grpc
import httpx
import pytest
from pagedserve.services.common.config import PublicTlsConfig
from pagedserve.services.gateway.app import start_gateway
from pagedserve.services.gateway.config import GatewayConfig, HttpConfig
from pagedserve.services.rpc.internal.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pagedserve.services.rpc.tls import internal_channel
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from pagedserve.certificates import ThrowAwayCertificates
from tests.e2e.stack import assert_idle

GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def certificates():
    certificates = ThrowAwayCertificates(("gateway", "scheduler", "worker", "client"))
    yield certificates
    certificates.remove()


@pytest.fixture(scope="module")
def stack_options(certificates):
    return {"certificates": certificates}


def generate(stack) -> list[int]:
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        response = stub.Generate(gateway_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(token_ids=[1, 2, 3, 4]), sampling=GREEDY), timeout=60)
    return list(response.outputs[0].token_ids)


def worker_call(channel: grpc.Channel) -> None:
    """The call issue 16 found fatal from any process: a ClearState with the largest epoch."""
    worker_pb2_grpc.WorkerServiceStub(channel).ClearState(
        worker_pb2.ClearStateRequest(scheduler_epoch=2**64 - 1), timeout=10)


def scheduler_call(channel: grpc.Channel) -> None:
    scheduler_pb2_grpc.SchedulerServiceStub(channel).GetLoad(scheduler_pb2.GetLoadRequest(),
                                                             timeout=10)


def internal_targets(stack):
    return [(f"127.0.0.1:{stack.worker[0].port}", worker_call),
            (stack.scheduler_address, scheduler_call)]


def assert_refused(channel: grpc.Channel, call) -> None:
    with channel, pytest.raises(grpc.RpcError) as info:
        call(channel)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value


def test_the_stack_serves_through_mutual_tls(stack):
    assert len(generate(stack)) == 8
    load = assert_idle(stack)  # a client with a certificate of the stack's CA may call
    assert load.num_worker_rebuilds == 0


def test_a_client_without_a_certificate_cannot_call_worker_or_scheduler(stack, certificates):
    before = generate(stack)
    ca = (certificates.folder / "client" / "ca.crt").read_bytes()
    for address, call in internal_targets(stack):
        assert_refused(grpc.insecure_channel(address), call)
        # TLS that trusts the server but shows no certificate of its own
        assert_refused(grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)), call)
    assert generate(stack) == before  # the plaintext ClearState changed nothing
    assert_idle(stack)


def test_a_certificate_of_another_ca_is_refused(stack, certificates):
    other = ThrowAwayCertificates(("client",))
    try:
        ca = (certificates.folder / "client" / "ca.crt").read_bytes()
        foreign = other.folder / "client"
        for address, call in internal_targets(stack):
            # trusts the stack's CA, but its own certificate is from elsewhere
            assert_refused(grpc.secure_channel(address, grpc.ssl_channel_credentials(
                ca, (foreign / "tls.key").read_bytes(), (foreign / "tls.crt").read_bytes())),
                call)
            # all of another CA: the client refuses the server as well
            assert_refused(internal_channel(address, other.tls("client")), call)
    finally:
        other.remove()
    assert len(generate(stack)) == 8


def test_a_peer_of_another_role_is_refused_and_the_stack_keeps_serving(stack, certificates):
    """The gateway's certificate once took the live worker from its scheduler with
    InitCache(scheduler_epoch=2**64 - 1): every request failed until the worker restarted."""
    before = generate(stack)
    worker = f"127.0.0.1:{stack.worker[0].port}"
    for role, address, call in (
            ("gateway", worker, lambda channel: worker_pb2_grpc.WorkerServiceStub(
                channel).InitCache(worker_pb2.InitCacheRequest(
                    num_gpu_blocks=1, scheduler_epoch=2**64 - 1), timeout=10)),
            ("worker", stack.scheduler_address, scheduler_call)):
        with internal_channel(address, certificates.tls(role)) as channel, \
                pytest.raises(grpc.RpcError) as info:
            call(channel)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert f"role '{role}' may not call" in info.value.details()
    assert generate(stack) == before
    assert assert_idle(stack).num_worker_rebuilds == 0


def test_a_gateway_with_public_tls_serves_the_cli_and_refuses_plaintext(stack, certificates,
                                                                        capsys):
    from pagedserve.cli import main

    folder = certificates.folder / "gateway"
    gateway = stack.loop.run(start_gateway(GatewayConfig(
        port=0, scheduler_address=stack.scheduler_address, tls=certificates.tls("gateway"),
        public_tls=PublicTlsConfig(public_tls_cert=str(folder / "tls.crt"),
                                   public_tls_key=str(folder / "tls.key")),
        http=HttpConfig(http_port=-1))))
    try:
        address = f"127.0.0.1:{gateway.port}"
        argv = ["generate", "--address", address, "hello", "--max-tokens", "4",
                "--temperature", "0", "--ignore-eos"]
        assert main([*argv, "--tls-ca", str(folder / "ca.crt")]) == 0
        assert "finish: length; prompt" in capsys.readouterr().err
        assert main(argv) == 1  # plaintext to a TLS port
        assert "error: UNAVAILABLE" in capsys.readouterr().err
        # the HTTP door speaks HTTPS with the same certificate
        url = f"https://127.0.0.1:{gateway.http_port}/v1/models"
        assert httpx.get(url, verify=str(folder / "ca.crt"), timeout=30).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url.replace("https", "http"), timeout=30)
    finally:
        stack.loop.run(gateway.stop(grace_s=0))
