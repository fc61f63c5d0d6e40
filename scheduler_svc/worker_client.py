"""The scheduler's gRPC client for one worker, a WorkerHandle like the in-process Worker.

Calls are synchronous (EngineCore runs on the engine thread) except submit_step. Every call has
a deadline, so a worker that is gone fails a step fast (Unavailable) instead of hanging. The
handshake waits for the worker to come up, so the scheduler may start first and a rebuild waits
for a restarted worker. A step sent while the one before it still runs (async scheduling) starts
on the worker only when that one ends, so its step_timeout_s counts from the deadline of the
one ahead: each step has step_timeout_s of its own, however long the one ahead took of its own.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future

import grpc
from pagedserve.services.common.config import EngineConfig, TlsConfig
from pagedserve.services.common.step_plan import MemoryProfile, StepOutput, StepPlan, WorkerInfo
from pagedserve.services.common.structured_outputs import StructuredOutputsParams
from pagedserve.services.rpc.convert_worker import (
    memory_profile_from_proto,
    prepare_grammars_to_proto,
    step_output_from_proto,
    step_plan_to_proto,
    worker_info_from_proto,
)
from pagedserve.services.rpc.internal.v1 import worker_pb2, worker_pb2_grpc
from pagedserve.services.rpc.status import error_from_rpc
from pagedserve.services.rpc.tls import internal_channel
from pagedserve.services.rpc.tracing import client_interceptors

logger = logging.getLogger(__name__)

_MAX_MESSAGE_BYTES = 256 << 20  # ExecuteStep carries whole prompts
# a restarted worker is reconnected to within a second (gRPC's default backoff grows to 2 min)
_CHANNEL_OPTIONS = [("grpc.max_send_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", _MAX_MESSAGE_BYTES),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000)]


class WorkerClient:
    def __init__(self, address: str, config: EngineConfig, step_timeout_s: float,
                 startup_timeout_s: float, tls: TlsConfig | None = None) -> None:
        """`config` is the scheduler's: the worker refuses another block size or step budget."""
        self.address = address
        self.config = config
        self.step_timeout_s = step_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._channel = grpc.intercept_channel(
            internal_channel(address, tls, _CHANNEL_OPTIONS),
            *client_interceptors(address))
        self._stub = worker_pb2_grpc.WorkerServiceStub(self._channel)
        self._last_step: PendingStep | None = None

    def close(self) -> None:
        self._channel.close()

    def _call(self, method: str, request, timeout_s: float, wait_for_ready: bool = False):
        try:
            return getattr(self._stub, method)(request, timeout=timeout_s,
                                               wait_for_ready=wait_for_ready)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"worker {self.address} {method}") from e

    def load_model(self) -> WorkerInfo:
        response = self._call("LoadModel", worker_pb2.LoadModelRequest(),
                              self.startup_timeout_s, wait_for_ready=True)
        if response.kept_loaded_model:
            logger.info("worker %s has the model loaded already; not loaded again",
                        self.address)
        return worker_info_from_proto(response.info)

    def get_info(self) -> WorkerInfo:
        return worker_info_from_proto(
            self._call("GetInfo", worker_pb2.GetInfoRequest(), self.step_timeout_s).info)

    def profile_memory(self) -> MemoryProfile:
        request = worker_pb2.ProfileMemoryRequest(
            block_size=self.config.cache.block_size,
            max_num_batched_tokens=self.config.scheduler.max_num_batched_tokens,
            max_num_seqs=self.config.scheduler.max_num_seqs)
        return memory_profile_from_proto(
            self._call("ProfileMemory", request, self.startup_timeout_s))

    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int, scheduler_epoch: int) -> bool:
        """True if the worker kept the KV cache it had (same sizes)."""
        response = self._call("InitCache", worker_pb2.InitCacheRequest(
            num_gpu_blocks=num_gpu_blocks, num_cpu_blocks=num_cpu_blocks,
            block_size=self.config.cache.block_size, scheduler_epoch=scheduler_epoch),
            self.startup_timeout_s)
        if response.kept_cache:
            logger.info("worker %s kept its KV cache of %d GPU and %d CPU blocks (epoch %d)",
                        self.address, num_gpu_blocks, num_cpu_blocks, scheduler_epoch)
        return response.kept_cache

    def warm_up(self) -> int:
        return self._call("WarmUp", worker_pb2.WarmUpRequest(),
                          self.startup_timeout_s).num_graphs_captured

    def submit_step(self, plan: StepPlan) -> PendingStep:
        now = time.monotonic()
        ahead = self._last_step
        starts_by = ahead.deadline if ahead is not None and not ahead.done() else now
        deadline = starts_by + self.step_timeout_s
        call = self._stub.ExecuteStep.future(step_plan_to_proto(plan), timeout=deadline - now)
        self._last_step = PendingStep(call, self.address, deadline)
        return self._last_step

    def prepare_grammars(self, constraints: list[StructuredOutputsParams]) -> Future[None]:
        done: Future[None] = Future()
        call = self._stub.PrepareGrammars.future(prepare_grammars_to_proto(constraints),
                                                 timeout=self.step_timeout_s)

        def answered(call: grpc.Future) -> None:
            error = call.exception()
            if error is None:
                done.set_result(None)
            else:
                done.set_exception(error_from_rpc(error, f"worker {self.address} PrepareGrammars"))

        call.add_done_callback(answered)
        return done

    def clear_state(self, scheduler_epoch: int) -> None:
        response = self._call("ClearState",
                              worker_pb2.ClearStateRequest(scheduler_epoch=scheduler_epoch),
                              self.step_timeout_s)
        logger.info("worker %s cleared %d sequences (epoch %d)", self.address,
                    response.num_cleared_seqs, scheduler_epoch)

    def pull_kv_blocks(self, source_address: str, src_block_ids: list[int],
                       dst_block_ids: list[int], scheduler_epoch: int, timeout_s: float) -> int:
        """The worker copies blocks of another replica's worker into its own; the bytes."""
        return self._call("PullKvBlocks", worker_pb2.PullKvBlocksRequest(
            source_address=source_address, src_block_ids=src_block_ids,
            dst_block_ids=dst_block_ids, scheduler_epoch=scheduler_epoch), timeout_s).num_bytes


class PendingStep:
    """One ExecuteStep call as a StepFuture (scheduler_svc/step_window.py): `result()` has the
    concurrent.futures.Future signature."""

    def __init__(self, call: grpc.Future, address: str, deadline: float) -> None:
        self._call = call
        self._address = address
        self.deadline = deadline  # time.monotonic()

    def done(self) -> bool:
        return self._call.done()

    def result(self, timeout: float | None = None) -> StepOutput:
        try:
            response = self._call.result(timeout)
        except grpc.RpcError as e:
            raise error_from_rpc(e, f"worker {self._address} ExecuteStep") from e
        return step_output_from_proto(response)
