"""Memory of every service stays bounded whatever one request asks: a stack of three processes
(worker, scheduler, gateway) takes the hostile requests of issue 16 — n = 2^31 - 1, a million
stop strings, prompts just under --max-request-bytes, 50 MB requests on both doors, 20 streams
that never read — while each process's resident memory is sampled; no service grows past a
generous bound over its idle baseline, the stalled streams end, and everyone else is served."""

from __future__ import annotations

import asyncio
import subprocess
import threading
import time

import grpc
import httpx
import psutil
import pytest
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from pagedserve.supervisor import free_port
from tests.e2e.test_processes import SMALL_CACHE, pagedserve, stop, wait_serving

MAX_GROWTH_MB = 300
MAX_REQUEST_BYTES = 4 << 20
STALLED_TIMEOUT_S = 2
NUM_STALLED = 20


class RssPeaks:
    """Samples each process's resident set in a thread; `growth_mb` is the peak since `reset`
    over the value at `reset`."""

    def __init__(self, pids: dict[str, int]) -> None:
        self._processes = {role: psutil.Process(pid) for role, pid in pids.items()}
        self._lock = threading.Lock()
        self._baseline: dict[str, int] = {}
        self._peak: dict[str, int] = {}
        self._stopped = threading.Event()
        self.reset()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _rss(self) -> dict[str, int]:
        return {role: p.memory_info().rss for role, p in self._processes.items()}

    def reset(self) -> None:
        with self._lock:
            self._baseline = self._rss()
            self._peak = dict(self._baseline)

    def _sample(self) -> None:
        while not self._stopped.wait(0.02):
            try:
                rss = self._rss()
            except psutil.NoSuchProcess:
                return
            with self._lock:
                for role, value in rss.items():
                    self._peak[role] = max(self._peak[role], value)

    def growth_mb(self) -> dict[str, float]:
        rss = self._rss()
        with self._lock:
            return {role: (max(self._peak[role], rss[role]) - self._baseline[role]) / 2**20
                    for role in self._processes}

    def close(self) -> None:
        self._stopped.set()
        self._thread.join()


@pytest.fixture(scope="module")
def stack(tiny_served_model_dir):
    worker_port, scheduler_port, gateway_port, http_port = (free_port() for _ in range(4))
    model = ["--model", str(tiny_served_model_dir), *SMALL_CACHE]
    processes = {
        "worker": pagedserve("worker", *model, "--port", str(worker_port)),
        "scheduler": pagedserve("scheduler", *model, "--port", str(scheduler_port),
                                "--worker-addresses", f"127.0.0.1:{worker_port}"),
        "gateway": pagedserve("gateway", "--port", str(gateway_port), "--http-port",
                              str(http_port), "--scheduler-address",
                              f"127.0.0.1:{scheduler_port}", "--max-request-bytes",
                              str(MAX_REQUEST_BYTES), "--stalled-stream-timeout-s",
                              str(STALLED_TIMEOUT_S), stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL),
    }
    try:
        address = f"127.0.0.1:{gateway_port}"
        wait_serving(address, timeout_s=180)
        channel = grpc.insecure_channel(address)
        generation = gateway_pb2_grpc.GenerationServiceStub(channel)
        _assert_served(generation)  # warm: the first request's one-off allocations
        peaks = RssPeaks({role: p.pid for role, p in processes.items()})
        yield dict(generation=generation, address=address, peaks=peaks,
                   http_url=f"http://127.0.0.1:{http_port}/v1",
                   scheduler_address=f"127.0.0.1:{scheduler_port}", processes=processes)
        peaks.close()
        channel.close()
        for role in ("gateway", "scheduler", "worker"):
            assert stop(processes[role]) == 0, role
    finally:
        for process in processes.values():
            if process.poll() is None:
                process.kill()
                process.wait()


def _assert_served(generation) -> None:
    response = generation.Generate(gateway_pb2.GenerateRequest(
        text="the quick brown fox", sampling=common_pb2.SamplingParams(
            temperature=0.0, max_tokens=16, ignore_eos=True)), timeout=60)
    assert len(response.outputs[0].token_ids) == 16
    assert response.outputs[0].finish_reason == common_pb2.FINISH_REASON_LENGTH


def _refused(generation, request: gateway_pb2.GenerateRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        list(generation.GenerateStream(request, timeout=120))
    return error.value


def _assert_bounded(stack) -> None:
    growth = stack["peaks"].growth_mb()
    assert all(mb < MAX_GROWTH_MB for mb in growth.values()), growth
    for role, process in stack["processes"].items():
        assert process.poll() is None, f"the {role} exited ({process.returncode})"


def _wait_scheduler_idle(address: str, timeout_s: float = 60) -> scheduler_pb2.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
        deadline = time.monotonic() + timeout_s
        while True:
            load = scheduler.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
            if not (load.num_running_requests or load.num_waiting_requests
                    or load.num_gpu_blocks_used):
                return load
            assert time.monotonic() < deadline, load
            time.sleep(0.1)


def test_hostile_requests_leave_every_service_bounded_and_serving(stack):
    generation, invalid = stack["generation"], grpc.StatusCode.INVALID_ARGUMENT
    stack["peaks"].reset()
    huge_n = _refused(generation, gateway_pb2.GenerateRequest(
        text="hi", sampling=common_pb2.SamplingParams(n=2**31 - 1, temperature=1.0)))
    assert huge_n.code() == invalid and "max_num_seqs_per_request" in huge_n.details()

    stops = _refused(generation, gateway_pb2.GenerateRequest(
        text="hi", sampling=common_pb2.SamplingParams(stop=[f"s{i}" for i in range(10**6)])))
    assert stops.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, stops

    text = gateway_pb2.GenerateRequest(text="the fox ")
    text.text *= (MAX_REQUEST_BYTES - 64) // len(text.text)
    ids = gateway_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(
        token_ids=[300] * ((MAX_REQUEST_BYTES - 64) // 4)))  # the gateway counts 4 bytes an id
    for request in (text, ids):
        error = _refused(generation, request)
        assert error.code() == invalid and "prompt" in error.details(), error

    big = _refused(generation, gateway_pb2.GenerateRequest(text="x" * (50 << 20)))
    assert big.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, big
    http = httpx.post(f"{stack['http_url']}/completions", timeout=120, content=b"".join(
        [b'{"model": "m", "prompt": "', b"x" * (50 << 20), b'"}']),
        headers={"content-type": "application/json"})
    assert http.status_code == 413, http.text

    _assert_served(generation)
    _assert_bounded(stack)


def test_streams_that_never_read_end_and_leave_the_gateway_bounded(stack):
    """20 streams on a channel with a small receive window that no one reads: the gateway
    buffers a bounded amount for each, aborts them after --stalled-stream-timeout-s, and serves
    a normal client meanwhile."""

    async def body() -> list[grpc.aio.AioRpcError]:
        small_window = grpc.aio.insecure_channel(stack["address"], options=[
            ("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)])
        stub = gateway_pb2_grpc.GenerationServiceStub(small_window)
        stalled = [stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
            request_id=f"stalled-{i}", text="the fox", sampling=common_pb2.SamplingParams(
                temperature=1.0, seed=i, max_tokens=480, ignore_eos=True, n=2, logprobs=20)),
            timeout=180) for i in range(NUM_STALLED)]  # ~500 KB of output each
        await asyncio.to_thread(_assert_served, stack["generation"])
        # every stalled request ends in the scheduler with no help from its client
        await asyncio.to_thread(_wait_scheduler_idle, stack["scheduler_address"])
        ends = []
        for call in stalled:
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in call:
                    pass
            ends.append(error.value)
        await small_window.close()
        return ends

    stack["peaks"].reset()
    for error in asyncio.run(body()):
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, error
        assert f"stalled_stream_timeout_s={STALLED_TIMEOUT_S}" in error.details()
    _assert_served(stack["generation"])
    _assert_bounded(stack)
