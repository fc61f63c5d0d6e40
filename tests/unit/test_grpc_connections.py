"""The gateway's gRPC port does not hold connections forever: a client that never finishes its
handshake is closed after grpc_handshake_timeout_s, one with no call open after
grpc_max_connection_idle_s (its channel goes IDLE and reconnects on its next call)."""

import asyncio
import socket

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.services.gateway.app import server_options
from pagedserve.services.gateway.config import ConnectionLimitsConfig, GatewayConfig
from pagedserve.services.rpc.server import create_server

LIMITS = ConnectionLimitsConfig(grpc_handshake_timeout_s=0.3, grpc_max_connection_idle_s=0.5)


def serve(body):
    async def main():
        server, port = create_server([], options=server_options(GatewayConfig(connections=LIMITS)))
        await server.start()
        await server.set_serving(True)
        try:
            return await body(port)
        finally:
            await server.shutdown(0)

    return asyncio.run(main())


def read_until_closed(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        while sock.recv(65536):  # a socket timeout fails the test: still open
            pass


def test_a_client_that_never_sends_its_preface_is_closed():
    async def body(port):
        await asyncio.to_thread(read_until_closed, port)

    serve(body)


def test_a_connection_with_no_call_open_is_closed_and_reconnects():
    async def body(port):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            health = health_pb2_grpc.HealthStub(channel)
            await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert channel.get_state() == grpc.ChannelConnectivity.READY
            await asyncio.wait_for(
                channel.wait_for_state_change(grpc.ChannelConnectivity.READY), 5)
            assert channel.get_state() != grpc.ChannelConnectivity.READY
            response = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert response.status == health_pb2.HealthCheckResponse.SERVING

    serve(body)
