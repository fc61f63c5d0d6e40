import asyncio
import os
import signal

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from pagedserve.services.rpc.server import ServiceBinding, create_server
from pagedserve.services.rpc.v1 import gateway_pb2, gateway_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class SlowTokenize(gateway_pb2_grpc.GenerationServiceServicer):
    def __init__(self):
        self.started = asyncio.Event()
        self.release = asyncio.Event()

    async def Tokenize(self, request, context):
        self.started.set()
        await self.release.wait()
        return gateway_pb2.TokenizeResponse(token_ids=[1, 2, 3])


def make_server(servicer):
    return create_server([ServiceBinding(
        servicer, gateway_pb2_grpc.add_GenerationServiceServicer_to_server,
        "pagedserve.v1.GenerationService")], port=0)


async def check(channel, service=""):
    stub = health_pb2_grpc.HealthStub(channel)
    response = await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return response.status


def test_health_not_serving_until_marked_and_reflection_lists_services():
    async def main():
        server, port = make_server(SlowTokenize())
        assert port > 0 and server.port == port
        await server.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            before = (await check(channel), await check(channel, "pagedserve.v1.GenerationService"))
            await server.set_serving(True)
            after = (await check(channel), await check(channel, "pagedserve.v1.GenerationService"))
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            call = stub.ServerReflectionInfo(timeout=5)
            await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
            listed = await call.read()
            await call.done_writing()
        await server.shutdown(grace_s=0)
        return before, after, {s.name for s in listed.list_services_response.service}

    before, after, services = asyncio.run(main())
    assert before == (NOT_SERVING, NOT_SERVING)
    assert after == (SERVING, SERVING)
    assert {"pagedserve.v1.GenerationService", "grpc.health.v1.Health"} <= services


def test_sigterm_drains_then_stops_letting_calls_in_flight_finish():
    events = []

    async def main():
        servicer = SlowTokenize()
        server, port = make_server(servicer)
        await server.start()
        await server.set_serving(True)

        async def drain():
            events.append(("drain", server.is_draining))
            servicer.release.set()  # the owner's work in flight completes during the drain

        serving = asyncio.create_task(server.serve_until_signal(grace_s=5, drain=drain))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            in_flight = asyncio.ensure_future(stub.Tokenize(gateway_pb2.TokenizeRequest(), timeout=10))
            await servicer.started.wait()
            os.kill(os.getpid(), signal.SIGTERM)
            response = await in_flight
            await asyncio.wait_for(serving, 10)
            events.append(("response", list(response.token_ids)))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                await gateway_pb2_grpc.GenerationServiceStub(channel).Tokenize(
                    gateway_pb2.TokenizeRequest(), timeout=1)
            except grpc.aio.AioRpcError as err:
                events.append(("after", err.code()))

    asyncio.run(main())
    assert events[0] == ("drain", True)
    assert events[1] == ("response", [1, 2, 3])
    assert events[2][1] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_several_servers_share_the_port_all_serve_and_all_stop():
    async def main():
        servicer = SlowTokenize()
        servicer.release.set()
        server, port = create_server([ServiceBinding(
            servicer, gateway_pb2_grpc.add_GenerationServiceServicer_to_server,
            "pagedserve.v1.GenerationService")], port=0, num_servers=3)
        await server.start()
        await server.set_serving(True)
        answers = []
        for _ in range(12):  # a connection each: the kernel spreads them over the servers
            async with grpc.aio.insecure_channel(
                    f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
            ) as channel:
                response = await gateway_pb2_grpc.GenerationServiceStub(channel).Tokenize(
                    gateway_pb2.TokenizeRequest(), timeout=5)
                answers.append((await check(channel), list(response.token_ids)))
        await server.shutdown(grace_s=0)
        alone = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        rebound = alone.add_insecure_port(f"127.0.0.1:{port}")  # fails while one still listens
        await alone.stop(0)
        return len(server.servers), answers, rebound == port

    num_servers, answers, is_rebound = asyncio.run(main())
    assert num_servers == 3
    assert answers == [(SERVING, [1, 2, 3])] * 12
    assert is_rebound
