"""Roles on the internal ports (services/rpc/roles.py), over real mutual TLS on loopback: each
internal certificate names its role, the worker takes calls only from a scheduler and the
scheduler only from gateways, a refusal names role and method and comes before the request is
parsed, and a certificate made before roles gets a clear refusal."""

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.services.rpc.internal.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pagedserve.services.rpc.roles import (
    SCHEDULER_CALLERS,
    WORKER_CALLERS,
    RoleInterceptor,
    certificate_roles,
)
from pagedserve.services.rpc.server import ServiceBinding, create_server
from pagedserve.services.rpc.status import error_details
from pagedserve.services.rpc.tls import internal_aio_channel, internal_server_credentials

from pagedserve import certificates as certificates_module
from pagedserve.certificates import ThrowAwayCertificates

ROLES = ("gateway", "scheduler", "worker", "supervisor")


class Worker(worker_pb2_grpc.WorkerServiceServicer):
    def __init__(self) -> None:
        self.calls: list[str] = []

    async def InitCache(self, request, context):
        self.calls.append(f"InitCache {request.scheduler_epoch}")
        return worker_pb2.InitCacheResponse()

    async def ReadKvBlocks(self, request, context):
        self.calls.append(f"ReadKvBlocks {list(request.block_ids)}")
        yield worker_pb2.ReadKvBlocksResponse(num_blocks=len(request.block_ids))


class Scheduler(scheduler_pb2_grpc.SchedulerServiceServicer):
    async def GetLoad(self, request, context):
        return scheduler_pb2.GetLoadResponse(num_running_requests=7)

    async def SubmitStream(self, request_iterator, context):
        async for _ in request_iterator:
            yield scheduler_pb2.SubmitStreamResponse()


@pytest.fixture(scope="module")
def certificates():
    """The four roles, and "legacy": a certificate of the same CA as made before roles (no
    role URI)."""
    with_role = certificates_module._subject_alt_names

    def old_style(role, hosts):
        names = with_role(role, hosts)
        if role != "legacy":
            return names
        return type(names)([n for n in names if not isinstance(
            n, certificates_module.x509.UniformResourceIdentifier)])

    patch = pytest.MonkeyPatch()
    patch.setattr(certificates_module, "_subject_alt_names", old_style)
    try:
        certificates = ThrowAwayCertificates((*ROLES, "legacy"))
    finally:
        patch.undo()
    yield certificates
    certificates.remove()


def run(certificates, binding: ServiceBinding, callers, role: str, call):
    """`call(channel)` as a client of `role` against a server of `binding` guarded for
    `callers`; returns what it returned, or the grpc.aio.AioRpcError it raised."""
    async def main():
        server, port = create_server(
            [binding], credentials=internal_server_credentials(
                certificates.tls("worker"), "127.0.0.1", "worker"),
            interceptors=[RoleInterceptor(callers)])
        await server.start()
        await server.set_serving(True)
        try:
            async with internal_aio_channel(f"127.0.0.1:{port}", certificates.tls(role)
                                            ) as channel:
                return await call(channel)
        except grpc.aio.AioRpcError as e:
            return e
        finally:
            await server.servers[0].stop(0)

    return asyncio.run(main())


def worker_binding(servicer: Worker) -> ServiceBinding:
    return ServiceBinding(servicer, worker_pb2_grpc.add_WorkerServiceServicer_to_server,
                          "pagedserve.internal.v1.WorkerService")


def init_cache(channel):
    return worker_pb2_grpc.WorkerServiceStub(channel).InitCache(
        worker_pb2.InitCacheRequest(num_gpu_blocks=1, scheduler_epoch=2**64 - 1), timeout=10)


def test_certificates_name_their_role(certificates):
    for role in ROLES:
        assert certificate_roles((certificates.folder / role / "tls.crt").read_bytes()) == (role,)
    assert certificate_roles((certificates.folder / "legacy" / "tls.crt").read_bytes()) == ()


@pytest.mark.parametrize("role", ["gateway", "worker", "supervisor"])
def test_only_a_scheduler_may_call_the_worker(certificates, role):
    """The gateway's certificate once took the worker from its scheduler (InitCache with the
    largest epoch): now it is refused before the worker sees the call."""
    servicer = Worker()
    refused = run(certificates, worker_binding(servicer), WORKER_CALLERS, role, init_cache)
    assert isinstance(refused, grpc.aio.AioRpcError)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refused.details() == (f"role '{role}' may not call "
                                 "/pagedserve.internal.v1.WorkerService/InitCache: only "
                                 "'scheduler' may")
    assert error_details(refused).reason == "PERMISSION_DENIED"
    assert servicer.calls == []
    assert not isinstance(run(certificates, worker_binding(servicer), WORKER_CALLERS,
                              "scheduler", init_cache), grpc.aio.AioRpcError)
    assert servicer.calls == [f"InitCache {2**64 - 1}"]


@pytest.mark.parametrize("role", ["gateway", "scheduler", "worker"])
def test_only_a_worker_may_read_another_workers_kv_blocks(certificates, role):
    """A decode replica's worker pulls a prefill replica's blocks: the one worker method a
    scheduler may not call, and the only one a worker may."""
    async def read(channel):
        call = worker_pb2_grpc.WorkerServiceStub(channel).ReadKvBlocks(
            worker_pb2.ReadKvBlocksRequest(block_ids=[3]), timeout=10)
        return [msg async for msg in call]

    servicer = Worker()
    result = run(certificates, worker_binding(servicer), WORKER_CALLERS, role, read)
    if role == "worker":
        assert [msg.num_blocks for msg in result] == [1] and servicer.calls == ["ReadKvBlocks [3]"]
        return
    assert result.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "only 'worker' may" in result.details() and servicer.calls == []


def test_a_certificate_without_a_role_is_told_to_get_one(certificates):
    servicer = Worker()
    refused = run(certificates, worker_binding(servicer), WORKER_CALLERS, "legacy", init_cache)
    assert refused.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "names no pagedserve role" in refused.details()
    assert "spiffe://pagedserve/<role>" in refused.details()
    assert "must be issued again" in refused.details()
    assert servicer.calls == []


def test_a_refused_call_is_not_parsed(certificates):
    """Bytes that are no InitCacheRequest: a gateway is refused for its role, not for them."""
    async def garbage(channel):
        return await channel.unary_unary(
            "/pagedserve.internal.v1.WorkerService/InitCache")(b"\xff\xff\xff", timeout=10)

    assert run(certificates, worker_binding(Worker()), WORKER_CALLERS, "gateway",
               garbage).code() == grpc.StatusCode.PERMISSION_DENIED
    malformed = run(certificates, worker_binding(Worker()), WORKER_CALLERS, "scheduler", garbage)
    assert malformed.code() == grpc.StatusCode.INVALID_ARGUMENT  # parsed, as before, once let in
    assert error_details(malformed).reason == "MALFORMED_REQUEST"


@pytest.mark.parametrize("role, is_allowed", [("gateway", True), ("worker", False),
                                              ("scheduler", False), ("supervisor", False)])
def test_only_gateways_may_call_the_scheduler(certificates, role, is_allowed):
    binding = ServiceBinding(Scheduler(), scheduler_pb2_grpc.add_SchedulerServiceServicer_to_server,
                             "pagedserve.internal.v1.SchedulerService")

    async def calls(channel):
        stub = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        results = []
        for call in (
                lambda: stub.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10),
                lambda: _first_response(stub.SubmitStream(timeout=10), is_allowed)):
            try:
                results.append(await call())
            except grpc.aio.AioRpcError as e:
                results.append(e.code())
        return results

    load, stream = run(certificates, binding, SCHEDULER_CALLERS, role, calls)
    if is_allowed:
        assert load.num_running_requests == 7
        assert stream == scheduler_pb2.SubmitStreamResponse()
    else:
        assert load == stream == grpc.StatusCode.PERMISSION_DENIED


async def _first_response(call: grpc.aio.StreamStreamCall, write: bool):
    """The stream's first response; a refused caller writes nothing, since grpcio's aio client
    reports a write that lands after the server's status as INTERNAL, hiding that status
    (grpc/grpc#36066)."""
    if write:
        await call.write(scheduler_pb2.SubmitStreamRequest())
    return await call.read()


def test_health_answers_every_role(certificates):
    """`pagedserve serve` watches its children's Health with the supervisor's certificate."""
    async def check(channel):
        return await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=10)

    for role in (*ROLES, "legacy"):
        response = run(certificates, worker_binding(Worker()), WORKER_CALLERS, role, check)
        assert response.status == health_pb2.HealthCheckResponse.SERVING
