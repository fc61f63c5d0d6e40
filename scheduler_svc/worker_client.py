"""The scheduler's gRPC client for one worker: a `WorkerClient` is a WorkerHandle
(scheduler_svc/engine_core.py), so the engine drives remote workers exactly as it drives
in-process ones.

The calls are synchronous -- EngineCore runs on the scheduler's engine thread -- except
submit_step, which returns at once with a future (async scheduling). Every call carries
a deadline (startup_timeout_s for the handshake, step_timeout_s for the rest); a worker that is
gone or misses its deadline raises Unavailable, so a step fails fast instead of hanging. The
handshake waits for the worker to come up (wait_for_ready), so the scheduler may start first --
and so that EngineCore, rebuilding a worker that restarted, waits for it to be back.
Once tracing is set up, every call is a CLIENT span (services/rpc/tracing.py), child of the span
current on the calling thread (the engine step's, for ExecuteStep).
"""

from __future__ import annotations

import logging

import grpc
from pagedserve.services.common.config import EngineConfig, TlsConfig
from pagedserve.services.common.step_plan import MemoryProfile, StepOutput, StepPlan, WorkerInfo
from pagedserve.services.rpc.convert_worker import (
    memory_profile_from_proto,
    step_output_from_proto,
    step_plan_to_proto,
    worker_info_from_proto,
)
from pagedserve.services.rpc.status import error_from_rpc
from pagedserve.services.rpc.tls import internal_channel
from pagedserve.services.rpc.tracing import client_interceptors
from pagedserve.services.rpc.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

# ExecuteStep carries whole prompts; the default 4 MiB would cap a batch of long ones.
_MAX_MESSAGE_BYTES = 256 << 20
# A restarted worker is reconnected to within a second (gRPC's default backoff grows to 2 min).
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class WorkerClient:
    def __init__(self, address: str, config: EngineConfig, step_timeout_s: float,
                 startup_timeout_s: float, tls: TlsConfig | None = None) -> None:
        """`config` is the scheduler's: its block size and step budget must match the worker's
        (the worker refuses a mismatch); memory budgets and the model come from the worker's
        own flags. `tls`: the scheduler's internal certificates (mutual TLS); None or empty =
        plaintext."""
        self.address = address
        self.config = config
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._channel = grpc.intercept_channel(
            internal_channel(address, tls, _CHANNEL_OPTIONS),
            *client_interceptors(address))
        self._stub = worker_pb2_grpc.WorkerStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request, timeout_s: float, wait_for_ready: bool = False):
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s,
                                               wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"worker {self.address} {method}") from e

    # --- the handshake --------------------------------------------------------------------------

    def load_model(self) -> WorkerInfo:
        response = self._call("LoadModel", worker_pb2.LoadModelRequest(),
                              self.startup_timeout_s, wait_for_ready=True)
        return worker_info_from_proto(response.info)

    def get_info(self) -> WorkerInfo:
        return worker_info_from_proto(
            self._call("GetInfo", worker_pb2.GetInfoRequest(), self.step_timeout_s))

    def profile_memory(self) -> MemoryProfile:
        request = worker_pb2.ProfileMemoryRequest(
            block_size=self.config.cache.block_size,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
            max_num_seqs=self.config.scheduler.max_num_seqs)
        return memory_profile_from_proto(
            self._call("ProfileMemory", request, self.startup_timeout_s))

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, scheduler_epoch: int) -> None:
        self._call("InitCache", worker_pb2.InitCacheRequest(
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            block_size=self.config.cache.block_size, scheduler_epoch=scheduler_epoch),
            self.startup_timeout_s)

    def warm_up(self) -> int:
        """Returns the number of CUDA graphs the worker captured."""
        return self._call("WarmUp", worker_pb2.WarmUpRequest(),
                          self.startup_timeout_s).num_graphs_captured

    # --- steps ----------------------------------------------------------------------------------

    def submit_step(self, plan: StepPlan) -> PendingStep:
        """Send the step now; its result (or error) comes from the returned future."""
        call = self._stub.ExecuteStep.future(step_plan_to_proto(plan), timeout=self.step_timeout_s)
        return PendingStep(call, self.address)

    def clear_state(self, scheduler_epoch: int) -> None:
        response = self._call("ClearState",
                              worker_pb2.ClearStateRequest(scheduler_epoch=scheduler_epoch),
                              self.step_timeout_s)
        logger.info("worker %s cleared %d sequences (epoch %d)", self.address,
                    response.num_cleared_seqs, scheduler_epoch)


class PendingStep:
    """An ExecuteStep in flight; `result()` has the concurrent.futures.Future signature."""

    def __init__(self, call: grpc.Future, address: str) -> None:
        self._call = call
        self._address = address

    def result(self, timeout: float | None = None) -> StepOutput:
        try:
            response = self._call.result(timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"worker {self._address} ExecuteStep") from e
        return step_output_from_proto(response)
