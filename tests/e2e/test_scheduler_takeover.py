"""`pagedserve serve` restarts a scheduler killed with SIGKILL, and the new one takes the live
worker over -- the same process, its model not loaded again, its KV cache kept -- so requests
after the restart generate what they did before; `--data-parallel-size 2` runs two replicas."""

import os
import queue
import signal
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from pagedserve.services.common.config import TlsConfig
from pagedserve.services.rpc.internal.v1 import common_pb2 as internal_common_pb2
from pagedserve.services.rpc.internal.v1 import scheduler_pb2, scheduler_pb2_grpc
from pagedserve.services.rpc.tls import internal_channel
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from pagedserve.supervisor import free_port
from tests.e2e.submit_call import SubmitCall
from tests.e2e.test_processes import SMALL_CACHE, pagedserve, read_lines, stop, wait_serving

GREEDY = common_pb2.SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SEEDED = common_pb2.SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)


class Log:
    """Every line a process wrote so far, read as it comes."""

    def __init__(self, stream) -> None:
        self._lines = read_lines(stream)
        self.lines: list[str] = []

    def wait_for(self, needle: str, timeout_s: float, count: int = 1) -> str:
        deadline = time.monotonic() + timeout_s
        while sum(needle in line for line in self.lines) < count:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
            assert line is not None, f"the output ended before {needle!r}:\n{''.join(self.lines)}"
            self.lines.append(line)
        return [line for line in self.lines if needle in line][count - 1]

    def drain(self) -> None:
        while True:
            try:
                line = self._lines.get_nowait()
            except queue.Empty:
                return
            if line is None:
                return
            self.lines.append(line)

    def rest(self, timeout_s: float = 30) -> list[str]:
        """Every line, once the process closed its output."""
        while (line := self._lines.get(timeout=timeout_s)) is not None:
            self.lines.append(line)
        return self.lines

    def count(self, needle: str) -> int:
        self.drain()
        return sum(needle in line for line in self.lines)


def started_pids(log: Log, role: str, count: int, timeout_s: float = 60) -> list[int]:
    return [int(log.wait_for(f"started the {role} (pid", timeout_s, i + 1)
                .split("(pid ")[1].split(")")[0]) for i in range(count)]


def generate(stub, ids: list[int], sampling, timeout_s: float = 60) -> list[int]:
    return [t for r in stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=ids), sampling=sampling), timeout=timeout_s)
        for t in r.token_ids]


def generate_once_back(stub, ids: list[int], sampling, timeout_s: float = 120) -> list[int]:
    """generate, retried while the scheduler is still coming back (UNAVAILABLE)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return generate(stub, ids, sampling)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_killed_scheduler_is_restarted_and_takes_the_live_worker_over(tiny_served_model_dir):
    scheduler_port, worker_port = free_port(), free_port()
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--http-port", "0", "--scheduler-port", str(scheduler_port),
                       "--worker-port", str(worker_port), "--no-internal-tls", *SMALL_CACHE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = Log(serve.stdout), Log(serve.stderr)
        [worker_pid] = started_pids(err, "worker", 1)
        [scheduler_pid] = started_pids(err, "scheduler", 1)
        address = out.wait_for("pagedserve is serving", 180).split(" on ")[-1].strip()
        prompts = [([1, 2, 3], GREEDY), ([7, 8, 9, 10], SEEDED), ([4, 5], GREEDY)]
        long = common_pb2.SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            expected = [generate(stub, ids, sampling) for ids, sampling in prompts]
            expected_long = generate(stub, [3, 1, 4], long, timeout_s=180)
            call = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
                token_ids=common_pb2.TokenIds(token_ids=[3, 1, 4]), sampling=long), timeout=180)
            received = list(next(call).token_ids)
            os.kill(scheduler_pid, signal.SIGKILL)  # mid-generation
            received += [t for r in call for t in r.token_ids]
            assert received == expected_long  # resubmitted to the restarted scheduler
            assert "the scheduler exited on its own (code -9); started it again" in err.wait_for(
                "started it again", 30)
            [new_scheduler_pid] = started_pids(err, "scheduler", 2)[1:]
            assert new_scheduler_pid != scheduler_pid
            wait_serving(f"127.0.0.1:{scheduler_port}", timeout_s=120)
            after = [generate_once_back(stub, ids, sampling) for ids, sampling in prompts]
        assert after == expected
        err.wait_for("has the model loaded already; not loaded again", 10, count=2)
        err.wait_for("kept its KV cache", 10)
        assert err.count("kept its KV cache") == 1  # the first start allocated it
        assert err.count("started the worker (pid") == 1
        os.kill(worker_pid, 0)  # the same worker process still runs
        assert err.count("loaded LlamaForCausalLM from") == 1, "".join(err.lines)
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            load = scheduler_pb2_grpc.SchedulerServiceStub(channel).GetLoad(
                scheduler_pb2.GetLoadRequest(), timeout=10)
        assert load.num_worker_rebuilds == 0 and load.num_gpu_blocks_used == 0, load
        assert stop(serve, signal.SIGINT) == 0
    finally:
        if serve.poll() is None:
            serve.kill()


def _argv(pid: int, timeout_s: float = 30) -> list[str]:
    """The command line of a child of serve, once it runs the pagedserve command (right after
    the fork it still shows serve's)."""
    deadline = time.monotonic() + timeout_s
    while "pagedserve.cli" not in (argv := Path(f"/proc/{pid}/cmdline").read_bytes().decode()
                                   .split("\0")) or "serve" in argv:
        assert time.monotonic() < deadline, argv
        time.sleep(0.05)
    return argv


def _tls_dir(pid: int) -> str:
    argv = _argv(pid)
    return argv[argv.index("--internal-tls-dir") + 1]


def _submit(channel: grpc.Channel, request_id: str, ids: list[int]) -> list[int]:
    request = scheduler_pb2.SubmitRequest(
        request_id=request_id, prompt_token_ids=ids,
        sampling=internal_common_pb2.SamplingParams.FromString(GREEDY.SerializeToString()))
    events = SubmitCall(scheduler_pb2_grpc.SchedulerServiceStub(channel), request, timeout=60)
    return [t for event in events for delta in event.outputs for t in delta.token_ids]


def test_serve_with_two_data_parallel_replicas_runs_two_schedulers_that_each_serve(
        tiny_served_model_dir):
    """Mutual TLS (one throw-away CA for all) and metrics ports per replica; each scheduler
    generates the same; through the gateway too once it routes over several schedulers."""
    scheduler_port, metrics_port = free_port(), free_port()
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--http-port", "-1", "--data-parallel-size", "2",
                       "--scheduler-port", str(scheduler_port),
                       "--metrics-port", str(metrics_port),
                       *SMALL_CACHE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = Log(serve.stdout), Log(serve.stderr)
        worker_pids = started_pids(err, "worker", 2)
        scheduler_pids = started_pids(err, "scheduler", 2)
        gateway_pid = started_pids(err, "gateway", 1)[0]
        assert len(set(worker_pids)) == 2 and len(set(scheduler_pids)) == 2
        metrics = {role: [int(err.wait_for(f"{role} metrics on http://", 120, i + 1)
                              .split("/metrics")[0].rsplit(":", 1)[1]) for i in range(2)]
                   for role in ("scheduler", "worker")}
        # P: the gateway; per replica r: P + 1 + 2r its scheduler, P + 2 + 2r its worker
        assert sorted(metrics["scheduler"]) == [metrics_port + 1, metrics_port + 3]
        assert sorted(metrics["worker"]) == [metrics_port + 2, metrics_port + 4]
        gateway_argv = _argv(gateway_pid)
        addresses = gateway_argv[gateway_argv.index("--scheduler-address") + 1].split(",")
        assert addresses == [f"127.0.0.1:{scheduler_port}", f"127.0.0.1:{scheduler_port + 1}"]
        tls = TlsConfig(internal_tls_dir=_tls_dir(gateway_pid))
        outputs = []
        for i, scheduler in enumerate(addresses):
            with internal_channel(scheduler, tls) as channel:
                grpc.channel_ready_future(channel).result(timeout=120)
                deadline = time.monotonic() + 180
                while True:
                    try:
                        outputs.append(_submit(channel, f"replica-{i}", [1, 2, 3]))
                        break
                    except grpc.RpcError as e:
                        if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                            raise
                        time.sleep(0.5)
        assert len(outputs[0]) == GREEDY.max_tokens and outputs[0] == outputs[1]
        address = out.wait_for("pagedserve is serving", 180).split(" on ")[-1].strip()
        assert "(2 replicas)" in out.wait_for("pagedserve is serving", 1)
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            assert all(generate(stub, [1, 2, 3], GREEDY) == outputs[0] for _ in range(4))
        assert stop(serve, signal.SIGINT) == 0
        assert not [line for line in err.rest() if "Traceback" in line], "".join(err.lines)
        for pid in (*worker_pids, *scheduler_pids):
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if serve.poll() is None:
            serve.kill()
