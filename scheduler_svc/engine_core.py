"""The engine loop shared by the in-process LLMEngine and the scheduler service.

`EngineCore` owns the scheduler, the block manager and the output processor, and drives its
workers through `WorkerLike` -- the one seam: in-process `Worker`s here, gRPC clients with the
same methods in the scheduler service. It is not thread-safe: one caller (the engine loop) at a
time.
"""

from __future__ import annotations

import contextvars
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from scheduler_svc.block_manager import BlockManager
from scheduler_svc.output_processor import OutputProcessor
from scheduler_svc.outputs import RequestOutput, make_request_output
from scheduler_svc.scheduler import Scheduler, SchedulerOutput
from scheduler_svc.sequence import SequenceGroup
from services.config import EngineConfig
from services.errors import ConfigError, InvalidRequest, NotFound
from services.sampling_params import SamplingParams
from services.step_plan import MemoryProfile, StepOutput, StepPlan, WorkerInfo

logger = logging.getLogger(__name__)


class WorkerLike(Protocol):
    def load_model(self) -> WorkerInfo: ...
    def get_info(self) -> WorkerInfo: ...
    def profile_memory(self) -> MemoryProfile: ...
    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int,
                   scheduler_epoch: int) -> None: ...
    def warm_up(self) -> None: ...
    def execute_step(self, plan: StepPlan) -> StepOutput: ...
    def clear_state(self, scheduler_epoch: int) -> None: ...


@dataclass(frozen=True, slots=True)
class EngineLoad:
    num_running: int  # requests
    num_waiting: int
    num_swapped: int
    num_gpu_blocks_used: int  # blocks held only by the prefix cache count as free
    num_gpu_blocks: int
    num_cpu_blocks_used: int
    num_cpu_blocks: int
    prefix_cache_hit_rate: float  # in prompt tokens, since start
    num_preemptions: int


class EngineCore:
    def __init__(self, config: EngineConfig, workers: list[WorkerLike],
                 scheduler_epoch: int | None = None) -> None:
        """The startup handshake: load_model on every rank, profile_memory (the smallest block
        counts across ranks win, unless overridden), init_cache, warm_up. A fresh epoch (from
        the clock unless given) makes workers refuse steps of an earlier scheduler."""
        if not workers:
            raise ConfigError("EngineCore needs at least one worker, got none")
        self.config = config
        self.workers = workers
        self._pool = ThreadPoolExecutor(len(workers)) if len(workers) > 1 else None
        self.scheduler_epoch = (time.time_ns() // 1000 if scheduler_epoch is None
                                else scheduler_epoch)

        infos = self._on_all_workers(lambda w: w.load_model())
        self.worker_info = infos[0]
        self.max_model_len = min(info.max_model_len for info in infos)
        if config.model.max_model_len:
            self.max_model_len = min(self.max_model_len, config.model.max_model_len)
        self.vocab_size = self.worker_info.vocab_size
        self.eos_token_ids = list(self.worker_info.eos_token_ids)

        profiles = self._on_all_workers(lambda w: w.profile_memory())
        cache = config.cache
        self.num_gpu_blocks = cache.num_gpu_blocks_override or min(
            p.num_gpu_blocks for p in profiles)
        self.num_cpu_blocks = (cache.num_cpu_blocks_override if cache.num_cpu_blocks_override >= 0
                               else min(p.num_cpu_blocks for p in profiles))
        if self.num_gpu_blocks < 1:
            raise ConfigError(f"no room for KV-cache blocks on the device "
                              f"(num_gpu_blocks={self.num_gpu_blocks}); lower the model size or "
                              f"raise gpu_memory_utilization / kv_cache_memory_gib")
        self._on_all_workers(lambda w: w.init_cache(self.num_gpu_blocks, self.num_cpu_blocks,
                                                    self.scheduler_epoch))
        self._on_all_workers(lambda w: w.warm_up())
        logger.info("engine ready: %d GPU blocks, %d CPU blocks of %d tokens, max_model_len=%d",
                    self.num_gpu_blocks, self.num_cpu_blocks, cache.block_size, self.max_model_len)

        self.block_manager = BlockManager(cache.block_size, self.num_gpu_blocks,
                                          self.num_cpu_blocks, config.scheduler.watermark,
                                          cache.enable_prefix_caching)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   self.scheduler_epoch)
        self._seq_ids = itertools.count()
        self.output_processor = OutputProcessor(self.scheduler, self.eos_token_ids,
                                                self.max_model_len, self._seq_ids)
        self._groups: dict[str, SequenceGroup] = {}
        # what the latest step ran, for observers between steps (the service's step span)
        self.last_scheduled: SchedulerOutput | None = None

    # --- requests -----------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None) -> None:
        """Queue a request; bad input raises InvalidRequest naming the field and the value."""
        if not request_id:
            raise InvalidRequest("request_id must not be empty")
        if request_id in self._groups:
            raise InvalidRequest(f"request_id {request_id!r} is already in use")
        if not prompt_token_ids:
            raise InvalidRequest("prompt_token_ids must not be empty")
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt_token_ids must be in [0, vocab_size={self.vocab_size}), "
                                 f"got {bad[:8]}")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt_token_ids has {len(prompt_token_ids)} tokens; the prompt must be shorter "
                f"than max_model_len={self.max_model_len}")
        usable_blocks = self.num_gpu_blocks - self.block_manager.watermark_blocks
        num_prompt_blocks = -(-len(prompt_token_ids) // self.block_manager.block_size)
        if num_prompt_blocks > usable_blocks:
            raise InvalidRequest(
                f"prompt_token_ids has {len(prompt_token_ids)} tokens, which need "
                f"{num_prompt_blocks} KV-cache blocks; the cache has {usable_blocks} usable blocks")
        sampling.verify_for_model(self.vocab_size)
        if sampling.num_candidates > self.config.scheduler.max_num_seqs:
            raise InvalidRequest(f"best_of={sampling.num_candidates} exceeds "
                                 f"max_num_seqs={self.config.scheduler.max_num_seqs}")
        group = SequenceGroup.from_prompt(request_id, list(prompt_token_ids), sampling,
                                          next(self._seq_ids), priority, arrival_time)
        self._groups[request_id] = group
        self.scheduler.add_group(group)

    def abort_request(self, request_id: str) -> RequestOutput:
        """Finish a request with finish_reason "abort" and free its blocks; returns its last
        report. Unknown (or already finished) request ids raise NotFound."""
        group = self._groups.pop(request_id, None)
        if group is None:
            raise NotFound(f"request_id {request_id!r} is not running")
        self.scheduler.finish_group(group, "abort")
        report = make_request_output(group)
        assert report is not None, "a newly finished group always reports"
        return report

    def stop_sequence(self, request_id: str, index: int) -> RequestOutput | None:
        """Finish output `index` of a running request with finish_reason "stop" -- the caller
        matched a stop string in its text -- and free its blocks. Returns the request's report
        if that ended the request (its other outputs keep running otherwise). Beam search and
        best_of > n pick their winners only at the end: stop their strings in the final text."""
        group = self._groups.get(request_id)
        if group is None:
            raise NotFound(f"request_id {request_id!r} is not running")
        if not group.is_streamed:
            raise InvalidRequest(f"request_id {request_id!r} uses beam search or best_of > n; "
                                 "its outputs cannot be stopped one by one")
        seqs = [s for s in group.seqs if s.index == index and not s.is_finished]
        if not seqs:
            raise NotFound(f"request_id {request_id!r} has no running output index {index}")
        seqs[0].finish("stop")
        self.scheduler.release_finished(group)
        if not group.is_finished:
            return None
        del self._groups[request_id]
        return make_request_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def get_load(self) -> EngineLoad:
        bm = self.block_manager
        return EngineLoad(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_gpu_blocks_used=bm.num_gpu_blocks - bm.num_free_gpu_blocks,
            num_gpu_blocks=bm.num_gpu_blocks,
            num_cpu_blocks_used=bm.num_cpu_blocks - bm.num_free_cpu_blocks,
            num_cpu_blocks=bm.num_cpu_blocks, prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_preemptions=self.scheduler.num_preemptions)

    # --- the loop -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule → execute_step on every rank (rank 0's output is used) → process outputs.
        A failed step finishes the requests it touched with finish_reason "error", resets the
        workers' mirrors (new epoch, clear_state) and leaves every other request running."""
        scheduled = self.scheduler.schedule()
        self.last_scheduled = scheduled
        if scheduled.plan is None:
            outputs = [r for g in scheduled.rejected if (r := make_request_output(g)) is not None]
        else:
            try:
                step_output = self._execute(scheduled.plan)
            except Exception as exc:  # any worker failure: the engine keeps serving
                outputs = self._fail_step(scheduled, exc)
            else:
                outputs = self.output_processor.process(scheduled, step_output)
        for report in outputs:
            if report.finished:
                self._groups.pop(report.request_id, None)
        return outputs

    def _execute(self, plan: StepPlan) -> StepOutput:
        results = self._on_all_workers(lambda w: w.execute_step(plan))
        if results[0].step_id != plan.step_id:
            raise RuntimeError(f"rank 0 answered step_id {results[0].step_id} "
                               f"to step_id {plan.step_id}")
        return results[0]

    def _fail_step(self, scheduled: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        step_id = scheduled.plan.step_id if scheduled.plan else 0
        logger.error("step %d failed: %r", step_id, exc, exc_info=exc)
        message = f"engine step {step_id} failed: {exc}"
        affected = {id(item.group): item.group for item in scheduled.scheduled}
        # a failed swap-out may have lost their KV
        affected.update((id(g), g) for g in scheduled.swapped_out)
        for group in affected.values():
            if not group.is_finished:
                self.scheduler.finish_group(group, "error", message)
        self.scheduler_epoch += 1
        for worker in self.workers:
            try:
                worker.clear_state(self.scheduler_epoch)
            except Exception as clear_exc:
                logger.error("clear_state failed on a worker: %r", clear_exc)
        self.scheduler.forget_worker_state(self.scheduler_epoch)
        groups = list(affected.values()) + scheduled.rejected
        return [r for g in groups if (r := make_request_output(g)) is not None]

    def _on_all_workers(self, call):
        if self._pool is None:
            return [call(self.workers[0])]
        # each call runs in a copy of this thread's context, so the engine-step span (tracing)
        # stays the parent of every rank's ExecuteStep
        contexts = [contextvars.copy_context() for _ in self.workers]
        return list(self._pool.map(lambda ctx, w: ctx.run(call, w), contexts, self.workers))
