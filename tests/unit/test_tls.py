"""TLS flags and credentials (services/rpc/tls.py): the flags go together or not at all, bad
files are named, plaintext off loopback is warned about, the public port's TLS authenticates
the server (clients only with a client CA), and the health-only port answers probes in
plaintext while the service port refuses them."""

import asyncio
import logging

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.services.common.config import (
    PublicTlsConfig,
    SchedulerServiceConfig,
    TlsConfig,
    WorkerServiceConfig,
    from_args,
)
from pagedserve.services.common.errors import ConfigError
from pagedserve.services.gateway.config import GatewayConfig
from pagedserve.services.rpc.server import ServiceBinding, create_server
from pagedserve.services.rpc.tls import (
    internal_aio_channel,
    internal_server_credentials,
    is_loopback,
    public_server_credentials,
)
from pagedserve.services.rpc.v1 import gateway_pb2, gateway_pb2_grpc

from pagedserve.certificates import ThrowAwayCertificates
from pagedserve.cli import build_parser
from pagedserve.supervisor import free_port


class Tokenize(gateway_pb2_grpc.GenerationServiceServicer):
    async def Tokenize(self, request, context):
        return gateway_pb2.TokenizeResponse(token_ids=[1, 2, 3])


@pytest.fixture(scope="module")
def certificates():
    certificates = ThrowAwayCertificates(("server", "client"))
    yield certificates
    certificates.remove()


def pem(certificates, role: str, name: str) -> str:
    return str(certificates.folder / role / name)


def serve(credentials, health_port: int = 0):
    """A started Generation server (run inside a loop)."""
    return create_server([ServiceBinding(
        Tokenize(), gateway_pb2_grpc.add_GenerationServiceServicer_to_server,
        "pagedserve.v1.GenerationService")], port=0,
                         credentials=credentials, health_port=health_port)


def tokenize(channel: grpc.aio.Channel):
    return gateway_pb2_grpc.GenerationServiceStub(channel).Tokenize(
        gateway_pb2.TokenizeRequest(text="x"), timeout=10)


# --- flags --------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    ({"tls_cert": "a.crt"}, "tls_cert, tls_key and tls_ca go together, got only tls_cert='a.crt'"),
    ({"internal_tls_dir": "/tls", "tls_ca": "ca.crt"},
     "internal_tls_dir and tls_ca are alternatives"),
    ({"health_port": 70000}, "health_port must be in [0, 65535], got 70000"),
])
def test_internal_flags_go_together(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        TlsConfig(**kwargs)


def test_public_flags_go_together():
    with pytest.raises(ConfigError, match="public_tls_cert and public_tls_key go together"):
        PublicTlsConfig(public_tls_key="k.pem")
    with pytest.raises(ConfigError, match="public_tls_client_ca needs public_tls_cert"):
        PublicTlsConfig(public_tls_client_ca="ca.pem")


@pytest.mark.parametrize("command, config_cls", [
    ("worker", WorkerServiceConfig), ("scheduler", SchedulerServiceConfig),
    ("gateway", GatewayConfig)])
def test_every_service_takes_the_tls_flags(command, config_cls):
    args = build_parser().parse_args([command, "--internal-tls-dir", "/etc/tls",
                                      "--health-port", "8081", "--tls-server-name", "internal"])
    tls = from_args(config_cls, args).tls
    assert (tls.internal_tls_dir, tls.health_port, tls.tls_server_name) == (
        "/etc/tls", 8081, "internal")


def test_a_missing_or_foreign_file_is_named(tmp_path, certificates):
    with pytest.raises(ConfigError, match=f"internal_tls_dir: cannot read '{tmp_path}/ca.crt'"):
        internal_server_credentials(TlsConfig(internal_tls_dir=str(tmp_path)), "127.0.0.1", "w")
    (tmp_path / "ca.crt").write_text("not a certificate")
    with pytest.raises(ConfigError, match="tls_ca: .* is not a PEM file"):
        internal_server_credentials(TlsConfig(
            tls_ca=str(tmp_path / "ca.crt"), tls_cert=pem(certificates, "server", "tls.crt"),
            tls_key=pem(certificates, "server", "tls.key")), "127.0.0.1", "w")


def test_plaintext_off_loopback_is_warned_about(caplog):
    caplog.set_level(logging.WARNING)
    for host in ("127.0.0.1", "::1", "localhost"):
        assert internal_server_credentials(TlsConfig(), host, "worker") is None
    assert not caplog.records
    assert internal_server_credentials(TlsConfig(), "0.0.0.0", "worker") is None
    assert "the worker listens on 0.0.0.0 without TLS" in caplog.text
    assert not is_loopback("::") and not is_loopback("10.0.0.1") and is_loopback("[::1]")


# --- ports --------------------------------------------------------------------------------------


def test_public_tls_authenticates_the_server_and_client_certificates_are_optional(certificates):
    server_files = PublicTlsConfig(public_tls_cert=pem(certificates, "server", "tls.crt"),
                                   public_tls_key=pem(certificates, "server", "tls.key"))
    ca = (certificates.folder / "client" / "ca.crt").read_bytes()

    async def main():
        server, port = serve(public_server_credentials(server_files))
        await server.start()
        address = f"127.0.0.1:{port}"
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
            tokens = (await tokenize(channel)).token_ids
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                await tokenize(channel)
        await server.shutdown(0)
        return tokens, plaintext.value.code()

    assert asyncio.run(main()) == ([1, 2, 3], grpc.StatusCode.UNAVAILABLE)


def test_a_public_client_ca_makes_client_certificates_required(certificates):
    files = PublicTlsConfig(public_tls_cert=pem(certificates, "server", "tls.crt"),
                            public_tls_key=pem(certificates, "server", "tls.key"),
                            public_tls_client_ca=pem(certificates, "server", "ca.crt"))
    ca = (certificates.folder / "client" / "ca.crt").read_bytes()

    async def main():
        server, port = serve(public_server_credentials(files))
        await server.start()
        address = f"127.0.0.1:{port}"
        async with grpc.aio.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as anonymous:
                await tokenize(channel)
        client = grpc.ssl_channel_credentials(
            ca, (certificates.folder / "client" / "tls.key").read_bytes(),
            (certificates.folder / "client" / "tls.crt").read_bytes())
        async with grpc.aio.secure_channel(address, client) as channel:
            tokens = (await tokenize(channel)).token_ids
        await server.shutdown(0)
        return anonymous.value.code(), tokens

    assert asyncio.run(main()) == (grpc.StatusCode.UNAVAILABLE, [1, 2, 3])


def test_the_health_port_answers_probes_in_plaintext_and_nothing_else(certificates):
    health_port = free_port()

    async def main():
        server, port = serve(internal_server_credentials(
            certificates.tls("server"), "127.0.0.1", "worker"), health_port)
        await server.start()
        await server.set_serving(True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{health_port}") as channel:
            status = (await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="pagedserve.v1.GenerationService"),
                timeout=10)).status
            with pytest.raises(grpc.aio.AioRpcError) as other:
                await tokenize(channel)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as plaintext:
                await tokenize(channel)
        async with internal_aio_channel(f"127.0.0.1:{port}", certificates.tls("client")
                                        ) as channel:
            tokens = (await tokenize(channel)).token_ids
        await server.shutdown(0)
        return status, other.value.code(), plaintext.value.code(), tokens

    assert asyncio.run(main()) == (health_pb2.HealthCheckResponse.SERVING,
                                   grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNAVAILABLE,
                                   [1, 2, 3])


def test_tls_server_name_checks_the_certificate_against_a_fixed_name(certificates):
    """A certificate without the name dialled is refused; with tls_server_name naming one of
    its SANs it is accepted (how one certificate serves every address)."""
    async def main():
        server, port = serve(internal_server_credentials(
            certificates.tls("server"), "127.0.0.1", "worker"))
        await server.start()
        results = []
        for name in ("not-in-the-certificate", "localhost"):
            client = TlsConfig(internal_tls_dir=str(certificates.folder / "client"),
                               tls_server_name=name)
            async with internal_aio_channel(f"127.0.0.1:{port}", client) as channel:
                try:
                    await tokenize(channel)
                    results.append("ok")
                except grpc.aio.AioRpcError as e:
                    results.append(e.code())
        await server.shutdown(0)
        return results

    assert asyncio.run(main()) == [grpc.StatusCode.UNAVAILABLE, "ok"]
