"""Constrained streams (a JSON schema and a regex, greedy and seeded) over gRPC, each equal token
for token to its undisturbed run across a fault in the middle: a worker that dies and comes back
(the scheduler rebuilds it and recomputes) and a scheduler replica that dies (the gateway
resubmits each stream to the survivor with the outputs it already streamed); and a scheduler
that takes a live worker over masks each request by its own grammar."""

from __future__ import annotations

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

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
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.gateway.config import RoutingConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2
from pagedserve.worker_svc.servicer import start_worker
from transformers import AutoTokenizer

from tests.e2e.background import BackgroundLoop
from tests.e2e.replica_stack import start_replica_stack
from tests.e2e.stack import assert_idle, start_stack, tiny_config
from tests.e2e.test_replicas import stream, wait_idle

# long outputs, so that every stream is still running when the fault comes
LONG_JSON = {"type": "object", "properties": {"xs": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 150}}, "required": ["xs"], "additionalProperties": False}
LONG_REGEX = r"([a-z]+ [0-9]{1,3}\. ){150}"
MAX_TOKENS = 240


def _requests(tag: str) -> list[gateway_pb2.GenerateRequest]:
    constraints = [common_pb2.StructuredOutputs(json_schema=json.dumps(LONG_JSON)),
                   common_pb2.StructuredOutputs(regex=LONG_REGEX)]
    requests = []
    for i, constraint in enumerate(constraints):
        for seed in (None, 11 + i):
            sampling = common_pb2.SamplingParams(
                temperature=0.0 if seed is None else 1.0, max_tokens=MAX_TOKENS,
                structured_outputs=constraint)
            if seed is not None:
                sampling.seed = seed
            requests.append(gateway_pb2.GenerateRequest(
                request_id=f"{tag}-{len(requests)}", sampling=sampling,
                token_ids=common_pb2.TokenIds(token_ids=[5 + len(requests), 6, 7, 8])))
    return requests


def _run_with_fault(address: str, fault) -> tuple[list, list]:
    """Each request undisturbed, then all again with `fault()` once every stream has begun."""
    with ThreadPoolExecutor(4) as pool:
        expected = list(pool.map(lambda r: stream(address, r), _requests("ref")))
        first = threading.Semaphore(0)
        futures = [pool.submit(stream, address, r, first) for r in _requests("run")]
        for _ in futures:
            assert first.acquire(timeout=120)
        fault()
        return expected, [f.result(timeout=300) for f in futures]


def test_constrained_streams_survive_a_worker_restart_unchanged(tiny_served_model_dir):
    config = tiny_config(tiny_served_model_dir)
    stack = start_stack(config)
    try:
        def restart_worker():
            server, servicer = stack.worker
            stack.loop.run(server.shutdown(0))
            servicer.close()
            stack.worker = stack.loop.run(start_worker(config, WorkerServiceConfig(
                port=server.port)))

        expected, got = _run_with_fault(stack.gateway_address, restart_worker)
        assert got == expected
        assert all(len(out[0]) == MAX_TOKENS for out in expected)
        assert assert_idle(stack).num_worker_rebuilds == 1
    finally:
        stack.close()


def test_constrained_streams_survive_a_scheduler_replica_killed_unchanged(tiny_served_model_dir):
    stack = start_replica_stack(tiny_config(tiny_served_model_dir), 2,
                                routing=RoutingConfig(failover_timeout_s=60.0))
    try:
        victims = []

        def kill_busiest():
            victims.append(max(stack.replicas, key=lambda r: r.load().num_running_requests))
            assert victims[0].load().num_running_requests > 0
            stack.kill(victims[0])

        expected, got = _run_with_fault(stack.gateway_address, kill_busiest)
        assert got == expected
        assert all(len(out[0]) == MAX_TOKENS for out in expected)
        wait_idle(next(r for r in stack.replicas if r is not victims[0]))
    finally:
        stack.close()


def test_a_scheduler_taking_the_worker_over_masks_each_request_by_its_own_grammar(
        tiny_served_model_dir):
    """Each new scheduler numbers its sequences from 0 again: its first sequence is another
    request than the old scheduler's sequence 0, whose matcher the worker still holds."""
    config = EngineConfig(model=ModelConfig(model=str(tiny_served_model_dir)),
                          cache=CacheConfig(block_size=16, kv_cache_memory_gib=0.01,
                                            swap_space_gib=0.01),
                          device=DeviceConfig(device="cpu"))
    digits, letters = (SamplingParams(temperature=0.0, max_tokens=24, structured_outputs=(
        StructuredOutputsParams(regex=regex))) for regex in (r"[0-9]{40}", r"[a-z]{40}"))
    tokenizer = AutoTokenizer.from_pretrained(tiny_served_model_dir)
    loop = BackgroundLoop()
    server, servicer = loop.run(start_worker(config, WorkerServiceConfig(port=0)))
    clients = []

    def core() -> EngineCore:
        clients.append(WorkerClient(f"127.0.0.1:{server.port}", config, step_timeout_s=30,
                                    startup_timeout_s=120))
        return EngineCore(config, clients[-1:])

    def generate(engine: EngineCore, request_id: str, sampling: SamplingParams) -> list[int]:
        engine.add_request(request_id, [5, 6, 7], sampling)
        token_ids = []
        while engine.has_unfinished_requests():
            token_ids += [t for r in engine.step() for t in r.outputs[0].token_ids]
        return token_ids

    try:
        expected = generate(core(), "letters", letters)
        old = core()
        old.add_request("digits", [5, 6, 7], digits)
        token_ids = [t for _ in range(4) for r in old.step() for t in r.outputs[0].token_ids]
        assert re.fullmatch("[0-9]+", tokenizer.decode(token_ids)), tokenizer.decode(token_ids)
        assert generate(core(), "letters-again", letters) == expected
    finally:
        for client in clients:
            client.close()
        loop.run(server.shutdown(0))
        servicer.close()
        loop.close()
