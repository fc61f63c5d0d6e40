"""The ExecuteStep deadline: each step has step_timeout_s of its own. A step sent behind one
still running (async scheduling) waits for it on the worker, so its deadline counts from the one
ahead's; a step that takes longer than its own still fails, as from a hung worker."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from pagedserve.scheduler_svc.worker_client import WorkerClient
from pagedserve.services.common.config import EngineConfig
from pagedserve.services.common.errors import Unavailable
from pagedserve.services.common.step_plan import StepPlan
from pagedserve.services.rpc.internal.v1 import worker_pb2, worker_pb2_grpc

STEP_S = 1.0  # each step's time on the fake worker, which runs steps one at a time


class _SerialWorker(worker_pb2_grpc.WorkerServiceServicer):
    """Runs steps one at a time in step order, as a worker does, whatever order they arrive in."""

    def __init__(self) -> None:
        self._turn = threading.Condition()
        self._next_step_id = 1

    def ExecuteStep(self, request, context):
        with self._turn:
            self._turn.wait_for(lambda: request.step_id == self._next_step_id)
            time.sleep(STEP_S)  # the step's work
            self._next_step_id += 1
            self._turn.notify_all()
        return worker_pb2.ExecuteStepResponse(step_id=request.step_id)


@pytest.fixture()
def address():
    server = grpc.server(ThreadPoolExecutor(max_workers=4))
    worker_pb2_grpc.add_WorkerServiceServicer_to_server(_SerialWorker(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


def _plan(step_id: int) -> StepPlan:
    return StepPlan(scheduler_epoch=1, step_id=step_id, previous_step_id=step_id - 1)


def test_a_step_sent_behind_another_has_its_own_deadline(address):
    """Each step takes 1 s of a 1.6 s deadline; the second ends 2 s after it was sent (past a
    deadline counted from its sending), 1.2 s before its own."""
    client = WorkerClient(address, EngineConfig(), step_timeout_s=1.6, startup_timeout_s=5)
    first, second = client.submit_step(_plan(1)), client.submit_step(_plan(2))
    assert first.result().step_id == 1
    assert second.result().step_id == 2
    client.close()


def test_a_step_longer_than_its_deadline_fails(address):
    client = WorkerClient(address, EngineConfig(), step_timeout_s=STEP_S / 3,
                          startup_timeout_s=5)
    with pytest.raises(Unavailable):
        client.submit_step(_plan(1)).result()
    client.close()
