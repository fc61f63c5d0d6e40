"""The `pagedserve` command as real processes: `serve` runs the stack and stops it cleanly, and
starts a worker that was killed again (the scheduler rebuilds it; no stream notices); the
services started one by one survive and report a dead scheduler as UNAVAILABLE quickly."""

import os
import queue
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import httpx
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.rpc.internal.v1 import (
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from pagedserve.worker_svc.parallel import GROUP_BROKEN_EXIT_CODE
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.certificates import ThrowAwayCertificates
from pagedserve.llm import LLM
from pagedserve.supervisor import free_port

ROOT = Path(__file__).resolve().parents[2]
SMALL_CACHE = ["--kv-cache-memory-gib", "0.01", "--swap-space-gib", "0.01", "--device", "cpu"]


def pagedserve(*argv: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "pagedserve.cli", *argv], cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True, **kwargs)


def read_lines(stream) -> queue.Queue:
    """The stream's lines as they come, then None at its end."""
    lines: queue.Queue = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=read, daemon=True).start()
    return lines


def rest(lines: queue.Queue, timeout_s: float = 10) -> list[str]:
    return list(iter(lambda: lines.get(timeout=timeout_s), None))


def wait_for_line(lines: queue.Queue, needle: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        assert line is not None, f"the output ended before {needle!r}"
        if needle in line:
            return line


def wait_serving(address: str, timeout_s: float = 120) -> None:
    with grpc.insecure_channel(address) as channel:
        for response in health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service=""), wait_for_ready=True, timeout=timeout_s):
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                return


def stop(process: subprocess.Popen, sig=signal.SIGTERM, timeout_s: float = 30) -> int:
    if process.poll() is None:
        process.send_signal(sig)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        raise


def long_stream(stub, max_tokens: int, metadata=(), **fields):
    """A greedy GenerateStream of [1, 2, 3] that runs max_tokens tokens, started (its first
    response read): a request in flight while the test does something to the stack."""
    call = stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
        token_ids=common_pb2.TokenIds(token_ids=[1, 2, 3]),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True), **fields),
        timeout=120, metadata=metadata)
    next(call)
    return call


def test_serve_runs_the_stack_and_ctrl_c_stops_it(tiny_served_model_dir):
    """With default settings the internal ports take mutual TLS only, with certificates in a
    private folder that is gone once the stack stops."""
    scheduler_port, worker_port = free_port(), free_port()
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--scheduler-port", str(scheduler_port), "--worker-port", str(worker_port),
                       "--metrics-port", "0", "--max-num-seqs-per-request", "3",
                       "--http-port", "-1", *SMALL_CACHE, stdout=subprocess.PIPE,
                       stderr=subprocess.PIPE)
    try:
        out, err = read_lines(serve.stdout), read_lines(serve.stderr)
        worker_pid = int(wait_for_line(err, "started the worker (pid", 60)
                         .split("(pid ")[1].split(")")[0])
        scheduler_metrics = wait_for_line(err, "scheduler metrics on http://", 120).split(
            "metrics on ")[1].split()[0]
        address = wait_for_line(out, "pagedserve is serving", 180).split(" on ")[-1].strip()
        worker_argv = Path(f"/proc/{worker_pid}/cmdline").read_bytes().decode().split("\0")
        tls_dir = Path(worker_argv[worker_argv.index("--internal-tls-dir") + 1])
        assert tls_dir.parent.stat().st_mode & 0o777 == 0o700
        assert (tls_dir / "tls.key").stat().st_mode & 0o777 == 0o600
        for port, call in ((scheduler_port, lambda channel: scheduler_pb2_grpc.SchedulerServiceStub(
                channel).GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)),
                           (worker_port, lambda channel: worker_pb2_grpc.WorkerServiceStub(
                channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10))):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                with pytest.raises(grpc.RpcError) as refused:
                    call(channel)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
        http_url = wait_for_line(out, "OpenAI-compatible HTTP API on", 5).split(" on ")[-1].strip()
        models = httpx.get(f"{http_url}/models", timeout=30).json()
        assert models["data"][0]["id"] == tiny_served_model_dir.name
        example = wait_for_line(out, "pagedserve generate", 5).strip()
        assert f"--address {address}" in example
        assert "grpcurl -plaintext" in wait_for_line(out, "grpcurl", 5)

        generate = subprocess.run(
            [sys.executable, "-m", "pagedserve.cli", "generate", "--address", address,
             "the quick brown fox", "--max-tokens", "8", "--temperature", "0", "--ignore-eos"],
            cwd=ROOT, capture_output=True, text=True, timeout=60)
        assert generate.returncode == 0, generate.stderr
        assert "finish: length; prompt" in generate.stderr
        with grpc.insecure_channel(address) as channel:
            response = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(
                gateway_pb2.GenerateRequest(text="the quick brown fox", sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=8, ignore_eos=True)), timeout=30)
        assert generate.stdout == response.outputs[0].text + "\n"
        with urllib.request.urlopen(scheduler_metrics, timeout=10) as scraped:
            families = {f.name: f for f in text_string_to_metric_families(scraped.read().decode())}
        assert families["vllm:generation_tokens"].samples[0].value == 16  # two requests
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
            gateway_pb2_grpc.GenerationServiceStub(channel).Generate(gateway_pb2.GenerateRequest(
                text="hi", sampling=common_pb2.SamplingParams(n=4, temperature=1.0)), timeout=30)
        assert "max_num_seqs_per_request=3" in info.value.details()  # the gateway got the flag

        assert stop(serve, signal.SIGINT) == 0
        log = rest(err)
        order = [role for line in log for role in ("gateway", "scheduler", "worker")
                 if f"the {role} stopped (code 0)" in line]
        assert order == ["gateway", "scheduler", "worker"], "".join(log)
        assert not tls_dir.parent.exists()
    finally:
        if serve.poll() is None:
            serve.kill()


@pytest.mark.parametrize("given_as", ["flag", "file"])
def test_serve_passes_the_admin_token_to_its_gateway_outside_its_command_line(
        tiny_served_model_dir, tmp_path, given_as):
    """Only the admin aborts another caller's request; the token is in no child's argv."""
    token_file = tmp_path / "admin-token"
    token_file.write_text("0p3n-s3same\n")
    admin = (["--admin-token", "0p3n-s3same"] if given_as == "flag"
             else ["--admin-token-file", str(token_file)])
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--http-port", "0", "--no-internal-tls", *admin, *SMALL_CACHE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = read_lines(serve.stdout), read_lines(serve.stderr)
        address = wait_for_line(out, "pagedserve is serving", 180).split(" on ")[-1].strip()
        for child in psutil.Process(serve.pid).children(recursive=True):
            assert "0p3n-s3same" not in " ".join(child.cmdline())
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            call = long_stream(stub, 480, metadata=[("authorization", "Bearer alice")],
                               request_id="alices")
            for token in ("bob", "0p3n-s3sam"):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Abort(gateway_pb2.AbortRequest(request_id="alices"), timeout=30,
                               metadata=[("authorization", f"Bearer {token}")])
                assert refused.value.code() == grpc.StatusCode.NOT_FOUND, refused.value
            stub.Abort(gateway_pb2.AbortRequest(request_id="alices"), timeout=30,
                       metadata=[("authorization", "Bearer 0p3n-s3same")])
            assert list(call)[-1].finish_reason == common_pb2.FINISH_REASON_ABORT
        assert stop(serve, signal.SIGINT) == 0
        rest(err)
    finally:
        if serve.poll() is None:
            serve.kill()


def test_serve_hands_its_gateway_public_tls_and_the_request_limit(tiny_served_model_dir):
    """The gateway takes --public-tls-cert and --max-concurrent-requests from serve; serve,
    which lacks the certificate's CA, watches its health on a plaintext port of its own."""
    certificates = ThrowAwayCertificates(("gateway",))
    folder = certificates.folder / "gateway"
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--http-port", "-1", "--no-internal-tls",
                       "--public-tls-cert", str(folder / "tls.crt"),
                       "--public-tls-key", str(folder / "tls.key"),
                       "--max-concurrent-requests", "1", *SMALL_CACHE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = read_lines(serve.stdout), read_lines(serve.stderr)
        address = wait_for_line(out, "pagedserve is serving", 180).split(" on ")[-1].strip()
        http_url = wait_for_line(out, "OpenAI-compatible HTTP API on", 5).split(" on ")[-1].strip()
        assert "--tls-ca CA.pem" in wait_for_line(out, "pagedserve generate", 5)
        ca = (folder / "ca.crt").read_bytes()
        assert httpx.get(f"{http_url}/models", verify=str(folder / "ca.crt"),
                         timeout=30).status_code == 200
        with grpc.secure_channel(address, grpc.ssl_channel_credentials(ca)) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            call = long_stream(stub, 480)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(gateway_pb2.GenerateRequest(
                    token_ids=common_pb2.TokenIds(token_ids=[1, 2, 3]),
                    sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=30)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            call.cancel()
        assert stop(serve, signal.SIGINT) == 0
        rest(err)
    finally:
        if serve.poll() is None:
            serve.kill()
        certificates.remove()


def test_serve_starts_a_killed_worker_again_and_the_streams_complete_unchanged(
        tiny_served_model_dir):
    scheduler_port = free_port()
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--http-port", "0", "--scheduler-port", str(scheduler_port),
                       "--no-internal-tls", *SMALL_CACHE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = read_lines(serve.stdout), read_lines(serve.stderr)
        worker_pid = int(wait_for_line(err, "started the worker (pid", 60)
                         .split("(pid ")[1].split(")")[0])
        address = wait_for_line(out, "pagedserve is serving", 180).split(" on ")[-1].strip()
        sampling = common_pb2.SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
        prompts = [[1, 2, 3], [7, 8, 9, 10], [4, 5]]
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)

            def stream(ids):
                return stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
                    token_ids=common_pb2.TokenIds(token_ids=ids), sampling=sampling),
                    timeout=180)

            expected = [[t for r in stream(ids) for t in r.token_ids] for ids in prompts]
            calls = [stream(ids) for ids in prompts]
            firsts = [next(call) for call in calls]
            os.kill(worker_pid, signal.SIGKILL)
            outputs = [[t for r in (first, *call) for t in r.token_ids]
                       for first, call in zip(firsts, calls, strict=True)]
        assert outputs == expected
        assert "the worker exited on its own (code -9); started it again" in wait_for_line(
            err, "started it again", 5)
        with grpc.insecure_channel(f"127.0.0.1:{scheduler_port}") as channel:
            scheduler = scheduler_pb2_grpc.SchedulerServiceStub(channel)
            deadline = time.monotonic() + 5  # the load is a snapshot taken between steps
            while (load := scheduler.GetLoad(scheduler_pb2.GetLoadRequest(), timeout=10)
                   ).num_gpu_blocks_used and time.monotonic() < deadline:
                time.sleep(0.05)
        assert load.num_worker_rebuilds == 1 and load.num_gpu_blocks_used == 0, load
        assert stop(serve, signal.SIGINT) == 0
    finally:
        if serve.poll() is None:
            serve.kill()


def test_a_killed_scheduler_fails_open_calls_with_unavailable_within_5s(tiny_served_model_dir):
    worker_port, scheduler_port, gateway_port = free_port(), free_port(), free_port()
    model = ["--model", str(tiny_served_model_dir), *SMALL_CACHE]
    processes = [
        pagedserve("worker", *model, "--port", str(worker_port)),
        pagedserve("scheduler", *model, "--port", str(scheduler_port),
                   "--worker-addresses", f"127.0.0.1:{worker_port}"),
        pagedserve("gateway", "--port", str(gateway_port), "--http-port", "0",
                   "--scheduler-address", f"127.0.0.1:{scheduler_port}",
                   "--failover-timeout-s", "1"),
    ]
    worker, scheduler, gateway = processes
    address = f"127.0.0.1:{gateway_port}"
    try:
        wait_serving(address, timeout_s=180)
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            call = long_stream(stub, 500)
            scheduler.kill()
            killed_at = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                for _ in call:
                    pass
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE, info.value
            assert time.monotonic() - killed_at < 5
            # new requests fail fast too, and the gateway itself keeps answering
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                stub.Generate(gateway_pb2.GenerateRequest(text="hello"), timeout=30)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - start < 5
        assert stop(gateway) == 0
        assert stop(worker) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()


def test_llm_with_two_tensor_parallel_ranks_generates_what_one_worker_does(
        tiny_served_model_dir):
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [4, 5]]
    greedy = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    one = LLM(model=str(tiny_served_model_dir), device="cpu", kv_cache_memory_gib=0.01)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    two = LLM(model=str(tiny_served_model_dir), device="cpu", kv_cache_memory_gib=0.01,
              tensor_parallel_size=2)
    try:
        ranks = [rank.process for rank in two.engine.ranks]
        outputs = [o.outputs[0].token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
        assert outputs == expected
        # rank 1 dies: rank 0 leaves the broken group at the next step, and both come back
        ranks[1].kill()
        ranks[1].wait()
        outputs = [o.outputs[0].token_ids for o in two.generate(prompts, greedy, use_tqdm=False)]
        assert outputs == expected
        assert two.engine.get_load().num_worker_rebuilds == 2
        assert ranks[0].wait(10) == GROUP_BROKEN_EXIT_CODE
        restarted = [rank.process for rank in two.engine.ranks]
    finally:
        two.close()
    assert all(p.poll() is not None for p in restarted)  # close() stopped them


def test_llm_with_more_ranks_than_kv_heads_generates_what_one_worker_does(
        tiny_odd_vocab_model_dir):
    # 2 KV heads on 4 ranks (each on two), 510 vocabulary rows (the last rank pads 2); the
    # second prompt's ids lie in the last rank's rows
    prompts = [[1, 2, 3], [507, 508, 509, 4]]
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    model = str(tiny_odd_vocab_model_dir)
    one = LLM(model=model, device="cpu", kv_cache_memory_gib=0.01)
    expected = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, use_tqdm=False)]
    four = LLM(model=model, device="cpu", kv_cache_memory_gib=0.01, tensor_parallel_size=4,
               num_threads=1)
    try:
        outputs = [o.outputs[0].token_ids for o in four.generate(prompts, greedy, use_tqdm=False)]
    finally:
        four.close()
    assert outputs == expected


def test_serve_with_two_tensor_parallel_ranks_generates_what_one_worker_does(
        tiny_served_model_dir):
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11], [4, 5]]
    llm = LLM(model=str(tiny_served_model_dir), device="cpu", kv_cache_memory_gib=0.01)
    expected = [o.outputs[0].token_ids for o in llm.generate(
        prompts,
        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)]
    long = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    expected_long = [o.outputs[0].token_ids for o in llm.generate(prompts, long, use_tqdm=False)]
    serve = pagedserve("serve", "--model", str(tiny_served_model_dir), "--port", "0",
                       "--http-port", "0", "--tensor-parallel-size", "2", *SMALL_CACHE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = read_lines(serve.stdout), read_lines(serve.stderr)
        pids = [int(wait_for_line(err, "started the worker (pid", 60).split("(pid ")[1]
                    .split(")")[0]) for _ in range(2)]  # rank 0, then rank 1
        address = wait_for_line(out, "pagedserve is serving", 180).split(" on ")[-1].strip()
        with grpc.insecure_channel(address) as channel:
            stub = gateway_pb2_grpc.GenerationServiceStub(channel)
            calls = [stub.Generate.future(gateway_pb2.GenerateRequest(
                token_ids=common_pb2.TokenIds(token_ids=ids),
                sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=24,
                                                   ignore_eos=True)), timeout=60)
                for ids in prompts]  # batched: the ranks run the same steps together
            forked = [stub.Generate.future(gateway_pb2.GenerateRequest(  # several samples
                token_ids=common_pb2.TokenIds(token_ids=[1, 2, 3]), sampling=sampling),
                timeout=60) for sampling in (
                    common_pb2.SamplingParams(n=2, best_of=3, temperature=1.0, seed=7,
                                              max_tokens=12, ignore_eos=True),
                    common_pb2.SamplingParams(n=2, best_of=2, use_beam_search=True,
                                              temperature=0.0, max_tokens=12, ignore_eos=True))]
            outputs = [list(call.result().outputs[0].token_ids) for call in calls]
            for call in forked:
                assert [len(o.token_ids) for o in call.result().outputs] == [12, 12]
            assert outputs == expected
            # rank 1 dies mid-generation: rank 0 leaves the broken group, serve restarts both,
            # the scheduler rebuilds them and the streams go on
            streams = [stub.GenerateStream(gateway_pb2.GenerateStreamRequest(
                token_ids=common_pb2.TokenIds(token_ids=ids), sampling=common_pb2.SamplingParams(
                    temperature=0.0, max_tokens=400, ignore_eos=True)), timeout=180)
                for ids in prompts]
            firsts = [next(stream) for stream in streams]
            os.kill(pids[1], signal.SIGKILL)
            outputs = [[t for r in (first, *stream) for t in r.token_ids]
                       for first, stream in zip(firsts, streams, strict=True)]
        assert outputs == expected_long
        assert stop(serve, signal.SIGINT) == 0
        log = "".join(rest(err))
        assert log.count("the worker stopped (code 0)") == 2, log
        assert "rank 1 of 2: joining the tensor-parallel group" in log, log
        assert f"the worker exited on its own (code {-signal.SIGKILL})" in log, log
        assert f"the worker exited on its own (code {GROUP_BROKEN_EXIT_CODE})" in log, log
    finally:
        if serve.poll() is None:
            serve.kill()
