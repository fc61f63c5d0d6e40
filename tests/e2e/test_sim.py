"""The simulated worker behind the real gateway and scheduler: outputs are predictable token by
token through detokenization, streaming, stop strings and preemption, every block comes back,
and `pagedserve serve --device sim` restarts a killed worker without changing any output."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pagedserve.services.common.config import CacheConfig, DeviceConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from tests.e2e.stack import assert_idle
from tests.e2e.test_processes import pagedserve, read_lines, stop, wait_for_line
from tests.sim_tokens import expected_greedy

VOCAB = 512  # the served tiny model's
SIM = DeviceConfig(device="sim", sim_model="Llama-3-8B", sim_time_scale=0.02)


@pytest.fixture(scope="module")
def stack_config(stack_config):
    return dataclasses.replace(stack_config, device=SIM,
                               cache=CacheConfig(block_size=8, num_gpu_blocks_override=24,
                                                 num_cpu_blocks_override=16))


def _request(ids: list[int], **sampling) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(token_ids=ids),
                                       sampling=common_pb2.SamplingParams(**sampling))


def test_outputs_are_predictable_through_the_stack(stack):
    prompts = [[130 + i for i in range(n)] for n in (3, 17, 30, 8, 12, 25)]
    greedy = dict(temperature=0.0, max_tokens=40, ignore_eos=True)
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)

        def stream(ids):
            deltas = list(stub.GenerateStream(_request(ids, **greedy), timeout=60))
            return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas)

        # 6 sequences of up to 70 tokens need ~50 blocks of 8: 24 force preemptions
        with ThreadPoolExecutor(len(prompts)) as pool:
            streamed = list(pool.map(stream, prompts))
        unary = stub.Generate(_request(prompts[1], **greedy), timeout=60).outputs[0]
    assert [ids for ids, _ in streamed] == [expected_greedy(p, 40, VOCAB) for p in prompts]
    assert (list(unary.token_ids), unary.text) == streamed[1]
    assert unary.text  # detokenized
    assert stack.load().num_preemptions > 0
    assert_idle(stack)


def test_stop_strings_and_eos_end_sim_outputs(stack):
    ids = [140, 141, 142]
    with grpc.insecure_channel(stack.gateway_address) as channel:
        stub = gateway_pb2_grpc.GenerationServiceStub(channel)
        full = stub.Generate(_request(ids, temperature=0.0, max_tokens=30, ignore_eos=True),
                             timeout=60).outputs[0]
        stop_at = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
        stopped = stub.Generate(_request(ids, temperature=0.0, max_tokens=30, ignore_eos=True,
                                         stop=[stop_at]), timeout=60).outputs[0]
    assert stopped.finish_reason == common_pb2.FINISH_REASON_STOP
    assert stopped.text == full.text[:full.text.index(stop_at)]
    assert_idle(stack)


def test_serve_device_sim_survives_a_worker_kill(tiny_served_model_dir):
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--device", "sim", "--sim-model", "Llama-3-8B", "--sim-gpu", "L4",
                       "--sim-time-scale", "0.1", "--block-size", "8",
                       "--num-gpu-blocks-override", "64", stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    try:
        out, err = read_lines(serve.stdout), read_lines(serve.stderr)
        worker_pid = int(wait_for_line(err, "started the worker (pid", 60)
                         .split("(pid ")[1].split(")")[0])
        address = wait_for_line(out, "pagedserve is serving", 180).split(" on ")[-1].strip()
        prompts = [[150, 151, 152], [160, 161, 162, 163]]
        greedy = dict(temperature=0.0, max_tokens=200, ignore_eos=True)
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            calls = [stub.GenerateStream(_request(ids, **greedy), timeout=120)
                     for ids in prompts]
            firsts = [next(call) for call in calls]
            os.kill(worker_pid, signal.SIGKILL)
            outputs = [[t for r in (first, *call) for t in r.token_ids]
                       for first, call in zip(firsts, calls, strict=True)]
        assert outputs == [expected_greedy(p, 200, VOCAB) for p in prompts]
        wait_for_line(err, "started it again", 10)
        assert stop(serve, signal.SIGINT) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
