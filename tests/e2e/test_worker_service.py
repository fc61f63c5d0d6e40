"""The Worker service over loopback: the scheduler's WorkerClient gets exactly what an in-process
Worker computes, only the epoch of the last handshake is served, health follows the cache, a dead
worker is UNAVAILABLE at once."""

import dataclasses
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.scheduler_svc.engine_core import EngineCore
from pagedserve.scheduler_svc.worker_client import WorkerClient
from pagedserve.services.common.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    ModelConfig,
    WorkerServiceConfig,
)
from pagedserve.services.common.errors import InvalidRequest, StaleEpoch, Unavailable
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import NewSequence, RunningSequence, StepOutput, StepPlan
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.rpc.internal.v1 import common_pb2, worker_pb2
from pagedserve.worker_svc.servicer import create_worker_server
from pagedserve.worker_svc.worker import Worker

from tests import tiny_models
from tests.e2e.background import BackgroundLoop

EPOCH = 1_700_000_000_000_007  # the clock's, as EngineCore makes them


def _config(model_dir) -> EngineConfig:
    return EngineConfig(model=ModelConfig(model=str(model_dir)),
                        cache=CacheConfig(block_size=16, kv_cache_memory_gib=0.01,
                                          swap_space_gib=0.01),
                        device=DeviceConfig(device="cpu"))


def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="pagedserve.internal.v1.WorkerService"),
            timeout=5).status


def _without_timings(output: StepOutput) -> tuple:
    """What a step gave, whichever single samples travel packed."""
    return output.step_id, output.sampled_by_seq(), output.pooled


def _plans() -> list[StepPlan]:
    """A greedy sequence with top-3 logprobs and a seeded random one with prompt logprobs:
    prefill, then decode steps (the worker appends the tokens it samples itself)."""
    greedy = SamplingParams(temperature=0.0, max_tokens=8, logprobs=3)
    seeded = SamplingParams(temperature=0.9, top_k=20, seed=5, max_tokens=8, prompt_logprobs=2)
    return [StepPlan(scheduler_epoch=EPOCH, step_id=1, new_seqs=[
        NewSequence(seq_id=0, request_id="a", token_ids=[1, 17, 33, 99, 5], prompt_len=5,
                    block_ids=[0], num_computed_tokens=0, num_scheduled_tokens=5,
                    sampling=greedy),
        NewSequence(seq_id=1, request_id="b", token_ids=[1, 200, 4, 4, 8, 61, 7], prompt_len=7,
                    block_ids=[3], num_computed_tokens=0, num_scheduled_tokens=7,
                    sampling=seeded, seed=1234)])]


def _execute(client: WorkerClient, plan: StepPlan) -> StepOutput:
    return client.submit_step(plan).result()


def _decode(last: StepOutput, epoch: int = EPOCH) -> StepPlan:
    """The step after `last`: every sequence decodes the token it just sampled."""
    return StepPlan(scheduler_epoch=epoch, step_id=last.step_id + 1, previous_step_id=last.step_id,
                    running_seqs=[RunningSequence(seq_id=s.seq_id, new_token_ids=[],
                                                  block_ids_start=1, block_ids=[],
                                                  num_scheduled_tokens=1)
                                  for s in last.sampled_by_seq().values()])


@pytest.fixture(scope="module")
def served_worker(tiny_model_dir):
    config = _config(tiny_model_dir("llama"))
    loop = BackgroundLoop()
    server, servicer = loop.run(_create(config))
    loop.run(server.start())
    client = WorkerClient(f"127.0.0.1:{server.port}", config, step_timeout_s=30,
                        startup_timeout_s=120)
    yield config, server, client
    client.close()
    loop.run(server.shutdown(grace_s=0))
    servicer.close()
    loop.close()


async def _create(config):
    return create_worker_server(config, WorkerServiceConfig(port=0))


def test_execute_step_over_grpc_equals_in_process(served_worker):
    config, server, client = served_worker
    local = Worker(config)
    assert client.load_model() == local.load_model()
    assert _health(server.port) == health_pb2.HealthCheckResponse.NOT_SERVING
    remote_profile, local_profile = client.profile_memory(), local.profile_memory()
    assert remote_profile.num_gpu_blocks == local_profile.num_gpu_blocks > 0
    client.init_cache(32, 8, EPOCH)
    local.init_cache(32, 8, EPOCH)
    assert _health(server.port) == health_pb2.HealthCheckResponse.SERVING
    client.warm_up()

    plan = _plans()[0]
    greedy_tokens = []
    for _ in range(4):
        remote, expected = _execute(client, plan), local.execute_step(plan)
        assert _without_timings(remote) == _without_timings(expected)
        assert [len(s.token_ids) for s in remote.sampled_by_seq().values()] == [1, 1]
        greedy_tokens += list(remote.sampled_by_seq().values())[0].token_ids
        plan = _decode(remote)

    # The cache operations travel too, and run in the contract's order within one step: block 0
    # (sequence 0's KV) is swapped out to CPU block 2, swapped in to block 6 and copied to 5. A
    # sequence resumed on block 5 remotely must sample what one resumed on the untouched block 0
    # samples in process.
    cache_ops = StepPlan(scheduler_epoch=EPOCH, step_id=5, previous_step_id=4,
                         blocks_to_swap_out=[(0, 2)], blocks_to_swap_in=[(2, 6)],
                         blocks_to_copy=[(6, 5)])
    assert not _execute(client, cache_ops).sampled_by_seq()
    local.execute_step(cache_ops)
    first = _plans()[0].new_seqs[0]
    token_ids = first.token_ids + greedy_tokens

    def resume(block_id: int) -> StepPlan:
        seq = dataclasses.replace(first, seq_id=10, token_ids=token_ids, block_ids=[block_id],
                                  num_computed_tokens=len(token_ids) - 1,
                                  num_scheduled_tokens=1)
        return StepPlan(scheduler_epoch=EPOCH, step_id=6, previous_step_id=5, new_seqs=[seq])

    resumed = _execute(client, resume(5))
    assert _without_timings(resumed) == _without_timings(local.execute_step(resume(0)))
    assert len(list(resumed.sampled_by_seq().values())[0].token_ids) == 1


def test_only_the_handshake_epoch_is_served_and_a_newer_scheduler_takes_over(served_worker):
    """Over gRPC too: other epochs are FAILED_PRECONDITION (the message does not tell the
    worker's), ClearState cannot move the epoch, only a newer scheduler's handshake can."""
    config, _, client = served_worker
    client.load_model()
    client.init_cache(16, 4, EPOCH)
    first = _execute(client, _plans()[0])
    for other in (EPOCH - 1, EPOCH + 1, 2**64 - 1):
        with pytest.raises(StaleEpoch, match=f"scheduler_epoch={other}") as refused:
            _execute(client, dataclasses.replace(_decode(first), scheduler_epoch=other))
        assert str(EPOCH) not in str(refused.value)
        with pytest.raises(StaleEpoch) as refused:
            client.clear_state(other)
        assert str(EPOCH) not in str(refused.value)
    # its scheduler is still served
    assert len(_execute(client, _decode(first)).sampled_by_seq()) == 2
    with pytest.raises(StaleEpoch):
        client.init_cache(16, 4, EPOCH - 1)
    client.init_cache(16, 4, EPOCH + 1)
    with pytest.raises(StaleEpoch):
        client.clear_state(EPOCH)
    mismatched = WorkerClient(client.address, dataclasses.replace(
        config, cache=dataclasses.replace(config.cache, block_size=32)), 30, 30)
    with pytest.raises(InvalidRequest, match="block_size=32"):
        mismatched.profile_memory()
    mismatched.close()


def test_steps_that_arrive_out_of_order_run_in_previous_step_id_order(served_worker):
    """Async scheduling sends step n+1 while step n runs; the servicer runs them in order even
    if n+1's RPC comes first."""
    config, _, client = served_worker
    epoch = EPOCH + 10
    client.load_model()
    client.init_cache(32, 8, epoch)
    local = Worker(config)
    local.load_model()
    local.init_cache(32, 8, epoch)
    first = dataclasses.replace(_plans()[0], scheduler_epoch=epoch)
    expected_first = local.execute_step(first)
    second = _decode(expected_first, epoch)
    expected_second = local.execute_step(second)
    later = client.submit_step(second)
    time.sleep(0.2)  # its RPC is in and waits for step 1
    earlier = client.submit_step(first)
    assert _without_timings(earlier.result()) == _without_timings(expected_first)
    assert _without_timings(later.result()) == _without_timings(expected_second)


def test_a_new_scheduler_takes_the_worker_over_and_the_old_one_cannot_take_it_back(
        served_worker):
    """A restarted scheduler (a newer epoch) does the handshake on a worker its predecessor
    still drives: the predecessor's next step is refused, its handshake too, so its requests
    fail; the new scheduler's run."""
    config, _, client = served_worker
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    old = EngineCore(config, [client], scheduler_epoch=EPOCH + 20)
    old.add_request("old", [1, 17, 33, 99], greedy)
    old.step()
    new_client = WorkerClient(client.address, config, step_timeout_s=30, startup_timeout_s=120)
    new = EngineCore(config, [new_client], scheduler_epoch=EPOCH + 21)
    new.add_request("new", [1, 17, 33, 99], greedy)
    reports = []
    while old.has_unfinished_requests():
        reports += old.step()
    (failed,) = [r for r in reports if r.finished]
    assert failed.outputs[0].finish_reason == "error"
    error = failed.outputs[0].error
    assert "scheduler_epoch" in error and "not rebuilt" in error
    token_ids = []
    while new.has_unfinished_requests():
        token_ids += [t for r in new.step() for t in r.outputs[0].token_ids]
    assert len(token_ids) == 4
    new_client.close()


def test_a_dead_worker_is_unavailable_at_once(tiny_model_dir):
    config = _config(tiny_model_dir("llama"))
    loop = BackgroundLoop()
    server, servicer = loop.run(_create(config))
    loop.run(server.start())
    client = WorkerClient(f"127.0.0.1:{server.port}", config, step_timeout_s=30,
                        startup_timeout_s=30)
    with pytest.raises(Unavailable, match="no model loaded"):
        client.get_info()
    loop.run(server.shutdown(grace_s=0))
    servicer.close()
    loop.close()
    start = time.monotonic()
    with pytest.raises(Unavailable):
        _execute(client, _plans()[0])
    assert time.monotonic() - start < 5
    client.close()


def test_prepare_grammars_answers_once_the_sampling_rank_compiled_them(tmp_path):
    config = _config(tiny_models.make_served_model(tmp_path / "tiny-llama"))
    loop = BackgroundLoop()
    server, servicer = loop.run(_create(config))
    loop.run(server.start())
    client = WorkerClient(f"127.0.0.1:{server.port}", config, step_timeout_s=30,
                          startup_timeout_s=120)
    try:
        client.load_model()
        constraints = [StructuredOutputsParams(regex="[a-z]+"),
                       StructuredOutputsParams(choice=("yes", "no"))]
        client.prepare_grammars(constraints).result(30)
        cache = servicer._loaded().runner.grammars.cache
        assert len(cache) == 2 and all(cache.get(c).done() for c in constraints)
        with pytest.raises(grpc.RpcError) as refused:
            client._stub.PrepareGrammars(worker_pb2.PrepareGrammarsRequest(
                constraints=[common_pb2.StructuredOutputs()]), timeout=30)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "structured_outputs" in refused.value.details()
    finally:
        client.close()
        loop.run(server.shutdown(grace_s=0))
        servicer.close()
        loop.close()
