"""Over gRPC: a scheduler started after another (a later clock epoch) takes the served worker
over through the handshake alone -- LoadModel reports the model kept, InitCache the cache kept,
the worker core is the same object -- generates what its predecessor did, and the predecessor's
steps are refused."""

import grpc
import pytest
from pagedserve.scheduler_svc.engine_core import EngineCore
from pagedserve.scheduler_svc.worker_client import WorkerClient
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    WorkerServiceConfig,
)
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from pagedserve.worker_svc.servicer import create_worker_server

from tests.e2e.background import BackgroundLoop

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _generate(core: EngineCore, request_id: str, ids: list[int]) -> list[int]:
    core.add_request(request_id, ids, GREEDY)
    token_ids: list[int] = []
    while core.has_unfinished_requests():
        token_ids += [t for r in core.step() for t in r.outputs[0].token_ids]
    return token_ids


async def _create(config):
    return create_worker_server(config, WorkerServiceConfig(port=0))


@pytest.fixture
def served(tiny_model_dir):
    config = EngineConfig(model=ModelConfig(model=str(tiny_model_dir("llama"))),
                          cache=CacheConfig(block_size=16, kv_cache_memory_gib=0.01,
                                            swap_space_gib=0.01),
                          device=DeviceConfig(device="cpu"))
    loop = BackgroundLoop()
    server, servicer = loop.run(_create(config))
    loop.run(server.start())
    loop.run(servicer.load())
    clients: list[WorkerClient] = []

    def client() -> WorkerClient:
        clients.append(WorkerClient(f"127.0.0.1:{server.port}", config, step_timeout_s=30,
                                    startup_timeout_s=120))
        return clients[-1]

    yield config, servicer, client
    for c in clients:
        c.close()
    loop.run(server.shutdown(grace_s=0))
    servicer.close()
    loop.close()


def test_a_later_scheduler_takes_the_served_worker_over_without_reloading(served):
    config, servicer, client = served
    old = EngineCore(config, [client()])
    worker, cache = servicer.worker, servicer.worker.cache_engine
    expected = _generate(old, "before", [1, 17, 33, 99])
    old.add_request("orphan", [4, 5, 6], GREEDY)
    old.step()

    new = EngineCore(config, [client()])  # the restarted scheduler: the clock's epoch
    assert new.scheduler_epoch > old.scheduler_epoch
    assert servicer.worker is worker and worker.cache_engine is cache
    assert len(worker.runner.mirrors) == 0
    with grpc.insecure_channel(client().address) as channel:
        stub = worker_pb2_grpc.WorkerServiceStub(channel)
        assert stub.LoadModel(worker_pb2.LoadModelRequest(), timeout=30).kept_loaded_model
        assert stub.InitCache(worker_pb2.InitCacheRequest(
            num_gpu_blocks=new.num_gpu_blocks, num_cpu_blocks=new.num_cpu_blocks,
            block_size=16, scheduler_epoch=new.scheduler_epoch), timeout=30).kept_cache
        with pytest.raises(grpc.RpcError) as refused:  # only a handshake moves the epoch
            stub.ClearState(worker_pb2.ClearStateRequest(
                scheduler_epoch=new.scheduler_epoch + 1), timeout=30)
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert _generate(new, "after", [1, 17, 33, 99]) == expected

    reports = []
    while old.has_unfinished_requests():
        reports += old.step()
    (failed,) = [r for r in reports if r.finished]
    assert failed.outputs[0].finish_reason == "error"
    assert "scheduler_epoch" in failed.outputs[0].error
