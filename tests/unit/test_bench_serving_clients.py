"""bench.serving's load generator: N closed-loop streams spread over several client processes,
against a stand-in gateway that streams one token per message."""

from __future__ import annotations

import importlib.util
import multiprocessing
import sys
import threading
import types
from concurrent import futures

import grpc
import pytest
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc

from bench.common import make_workload
from bench.serving import RunResult, parse_args, run_clients
from bench.serving_clients import (
    ClientProcesses,
    ClientReport,
    Requests,
    RequestTrace,
    default_client_processes,
    start_processes,
)


class _CountingGateway(gateway_pb2_grpc.GenerationServiceServicer):
    """Streams max_tokens one-token messages; remembers every prompt it was sent."""

    def __init__(self, short_by: int = 0, hold: threading.Event | None = None) -> None:
        self.prompts: list[tuple[int, ...]] = []
        self._lock = threading.Lock()
        self._short_by = short_by
        self._hold = hold  # when set, every request but the one-token connects waits on it

    def GenerateStream(self, request, context):
        with self._lock:
            self.prompts.append(tuple(request.token_ids.token_ids))
        if self._hold is not None and request.sampling.max_tokens > 1:
            self._hold.wait(30)
        num_tokens = request.sampling.max_tokens - self._short_by
        for k in range(num_tokens):
            last = k == num_tokens - 1
            yield gateway_pb2.GenerateStreamResponse(
                text="a", token_ids=[7],
                finish_reason=common_pb2.FINISH_REASON_LENGTH if last else 0)


def _serve(gateway: _CountingGateway):
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    gateway_pb2_grpc.add_GenerationServiceServicer_to_server(gateway, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, f"127.0.0.1:{port}"


@pytest.fixture
def gateway():
    stand_in = _CountingGateway()
    server, address = _serve(stand_in)
    yield stand_in, address
    server.stop(None)


def test_streams_over_several_processes_send_every_request_once(gateway):
    stand_in, address = gateway
    wl = make_workload("n6", 15, (3, 6), (2, 5), 5000, seed=1)
    connect = make_workload("connect6", 6, (2, 2), (1, 1), 5000, seed=2)
    result = run_clients("grpc", address, wl, 6, connect, 3)

    timed = stand_in.prompts[len(connect.prompts):]
    assert sorted(stand_in.prompts[:len(connect.prompts)]) == sorted(map(tuple, connect.prompts))
    assert sorted(timed) == sorted(map(tuple, wl.prompts))
    assert sorted(t.num_tokens for t in result.traces) == sorted(wl.output_lens)
    summary = result.summary()
    assert summary["num_output_tokens"] == wl.num_output_tokens
    assert [c["num_streams"] for c in summary["client_processes"]] == [2, 2, 2]
    assert sum(c["num_requests"] for c in summary["client_processes"]) == 15


def test_a_short_stream_fails_the_run():
    server, address = _serve(_CountingGateway(short_by=1))
    try:
        wl = make_workload("n2", 2, (3, 3), (3, 3), 5000)
        with pytest.raises(RuntimeError, match="streamed 2 tokens, asked for 3"):
            run_clients("grpc", address, wl, 2, wl, 2)
    finally:
        server.stop(None)


def test_a_client_process_busier_than_four_fifths_of_a_core_is_flagged():
    trace = RequestTrace(0.0, [0.01, 0.02], 2)
    idle = ClientReport([trace], 32, 0.0, 1.0, 0.3)
    busy = ClientReport([trace], 32, 0.0, 1.0, 0.9)
    assert not RunResult(1.0, [trace], clients=[idle]).summary()["is_client_saturated"]
    summary = RunResult(1.0, [trace, trace], clients=[idle, busy]).summary()
    assert summary["is_client_saturated"] and summary["max_client_busy"] == pytest.approx(0.9)


@pytest.mark.parametrize(("concurrency", "num_cores", "expected"), [
    (1, 16, 1), (32, 16, 1), (33, 16, 2), (256, 16, 8), (1024, 16, 8), (256, 2, 1)])
def test_default_client_processes(concurrency, num_cores, expected):
    assert default_client_processes(concurrency, num_cores) == expected


def test_negative_client_processes_is_refused(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--client-processes", "-1"])
    assert "--client-processes must be >= 0, got -1" in capsys.readouterr().err


_PROBE = ("import sys, bench.serving_clients\n"
          "found.put(sorted({'torch', 'pagedserve.llm_engine', 'bench.serving'}"
          " & set(sys.modules)))")


def test_a_client_process_imports_neither_torch_nor_the_parents_main(monkeypatch):
    """As under `python -m bench.serving`: spawn would re-import __main__ (torch, the engine) in
    every client process by its spec's name."""
    main = types.ModuleType("__main__")
    main.__spec__ = importlib.util.find_spec("bench.serving")
    monkeypatch.setitem(sys.modules, "__main__", main)
    ctx = multiprocessing.get_context("spawn")
    found = ctx.Queue()
    proc = ctx.Process(target=exec, args=(_PROBE, {"found": found}))
    start_processes([proc])
    try:
        assert found.get(timeout=60) == []
    finally:
        proc.join(10)
    assert sys.modules["__main__"] is main


def test_a_hung_client_process_fails_the_run_instead_of_hanging_it():
    hold = threading.Event()
    server, address = _serve(_CountingGateway(hold=hold))
    wl = make_workload("n2", 2, (3, 3), (3, 3), 5000)
    connect = make_workload("connect2", 2, (2, 2), (1, 1), 5000)
    clients = ClientProcesses("grpc", address, Requests(wl.prompts, wl.output_lens),
                              Requests(connect.prompts, connect.output_lens), 2, 1,
                              run_timeout_s=1.0)
    try:
        clients.start()
        with pytest.raises(RuntimeError, match=r"hung: not every one reported its run within 1 s"):
            clients.run()
    finally:
        clients.close()
        hold.set()
        server.stop(None)
