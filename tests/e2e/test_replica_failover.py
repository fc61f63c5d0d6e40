"""`pagedserve serve --data-parallel-size 2` as real processes: SIGKILL one scheduler while 16
streams run (greedy, seeded, penalties, n=2) and every stream completes on the other replica
(or the restarted one), token-identical to a run without the fault."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc

from pagedserve.supervisor import free_port
from tests.e2e.test_processes import SMALL_CACHE, pagedserve, stop
from tests.e2e.test_replicas import MAX_TOKENS, NUM_STREAMS, requests, stream
from tests.e2e.test_scheduler_takeover import Log, started_pids


def load(address: str) -> scheduler_pb2.GetLoadResponse:
    with grpc.insecure_channel(address) as channel:
        return scheduler_pb2_grpc.SchedulerServiceStub(channel).GetLoad(
            scheduler_pb2.GetLoadRequest(), timeout=10)


def test_a_scheduler_killed_under_16_streams_costs_no_stream_a_token(tiny_served_model_dir):
    scheduler_port = free_port()
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--http-port", "-1", "--data-parallel-size", "2", "--no-internal-tls",
                       "--scheduler-port", str(scheduler_port), *SMALL_CACHE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    schedulers = [f"127.0.0.1:{scheduler_port}", f"127.0.0.1:{scheduler_port + 1}"]
    try:
        out, err = Log(serve.stdout), Log(serve.stderr)
        scheduler_pids = started_pids(err, "scheduler", 2)
        address = out.wait_for("pagedserve is serving", 180).split(" on ")[-1].strip()
        with ThreadPoolExecutor(NUM_STREAMS) as pool:
            expected = list(pool.map(lambda r: stream(address, r), requests("ref")))
            first = threading.Semaphore(0)
            futures = [pool.submit(stream, address, r, first) for r in requests("run")]
            for _ in range(NUM_STREAMS):
                assert first.acquire(timeout=120)
            running = [load(s).num_running_requests for s in schedulers]
            victim = running.index(max(running))
            assert running[victim] > 0
            os.kill(scheduler_pids[victim], signal.SIGKILL)
            got = [f.result(timeout=300) for f in futures]
        for i, (output, reference) in enumerate(zip(got, expected, strict=True)):
            assert output == reference, f"stream {i} differs"
            assert all(len(tokens) == MAX_TOKENS for tokens in output.values())
        survivor = schedulers[1 - victim]
        deadline = time.monotonic() + 30
        while (idle := load(survivor)).num_gpu_blocks_used or idle.num_running_requests:
            assert time.monotonic() < deadline, idle
            time.sleep(0.1)
        assert stop(serve, signal.SIGINT) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
