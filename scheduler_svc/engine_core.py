"""The engine loop shared by the in-process LLMEngine and the scheduler service; not thread-safe.

Async scheduling: while step n runs, step n+1 is planned and sent, so the workers never wait for
the scheduler. step() waits for step n, takes in its tokens, sends step n+2 behind n+1, and only
then builds step n's reports: between two calls steps n+1 and n+2 are in flight. Which step may
be sent when, and what a failure does to the steps behind it, is StepWindow's
(scheduler_svc/step_window.py).
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from pagedserve.scheduler_svc.block_manager import BlockManager
from pagedserve.scheduler_svc.output_processor import OutputProcessor
from pagedserve.scheduler_svc.outputs import make_request_output
from pagedserve.scheduler_svc.request_checks import (
    RequestLimits,
    check_admission,
    check_request,
    check_resumed_outputs,
)
from pagedserve.scheduler_svc.scheduler import ScheduledStep, Scheduler
from pagedserve.scheduler_svc.sequence import SequenceGroup
from pagedserve.scheduler_svc.stats import (
    FinishedRequestStats,
    HostCopyStats,
    StatLogger,
    StepStats,
    StepTotals,
)
from pagedserve.scheduler_svc.step_window import SentStep, StepFuture, StepWindow
from pagedserve.services.common.config import EngineConfig, GiB
from pagedserve.services.common.drain_rate import DrainRate
from pagedserve.services.common.engine_api import EngineLoad
from pagedserve.services.common.errors import ConfigError, InvalidRequest, NotFound, Reason
from pagedserve.services.common.outputs import FinishReason, RequestOutput
from pagedserve.services.common.sampling_params import SamplingParams
from pagedserve.services.common.step_plan import (
    MemoryProfile,
    StepOutput,
    StepPlan,
    StepTimings,
    WorkerInfo,
)
from pagedserve.services.common.structured_outputs import StructuredOutputsParams

logger = logging.getLogger(__name__)

# rebuilds with no step done between, after which the failed steps' requests are blamed
MAX_REBUILDS_IN_A_ROW = 3


class WorkerHandle(Protocol):
    def load_model(self) -> WorkerInfo: ...
    def get_info(self) -> WorkerInfo: ...
    def profile_memory(self) -> MemoryProfile: ...
    def init_cache(self, num_gpu_blocks: int, num_cpu_blocks: int,
                   scheduler_epoch: int) -> bool: ...  # True: kept its cache
    def warm_up(self) -> None: ...
    def submit_step(self, plan: StepPlan) -> StepFuture: ...  # steps run in submission order
    def prepare_grammars(self, constraints: list[StructuredOutputsParams]) -> Future[None]: ...
    def clear_state(self, scheduler_epoch: int) -> None: ...


class StepObserver(Protocol):
    def step_sent(self, scheduled: ScheduledStep) -> contextlib.AbstractContextManager[Any]:
        """Entered around the submission; what it yields comes back to step_done."""

    def step_done(self, handle: Any, scheduled: ScheduledStep,
                  outputs: list[RequestOutput]) -> None:
        """After a failure, `outputs` carry the errors."""


class EngineCore:
    def __init__(self, config: EngineConfig, workers: list[WorkerHandle],
                 scheduler_epoch: int | None = None) -> None:
        """The startup handshake; its fresh epoch takes the workers over from any earlier
        scheduler."""
        if not workers:
            raise ConfigError("EngineCore needs at least one worker, got none")
        self.config = config
        self.workers = workers
        self._pool = ThreadPoolExecutor(len(workers)) if len(workers) > 1 else None
        self.scheduler_epoch = (time.time_ns() // 1000 if scheduler_epoch is None
                                else scheduler_epoch)
        self._load_model()
        self._allocate_cache()
        cache = config.cache
        self.block_manager = BlockManager(cache.block_size, self.num_gpu_blocks,
                                          self.num_cpu_blocks, config.scheduler.watermark,
                                          cache.enable_prefix_caching, self.num_offload_blocks)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len,
                                   self.scheduler_epoch)
        self._limits = RequestLimits(
            vocab_size=self.vocab_size, max_model_len=self.max_model_len,
            block_size=cache.block_size,
            num_usable_blocks=self.num_gpu_blocks - self.block_manager.watermark_blocks,
            max_best_of=config.scheduler.max_best_of, max_num_seqs=config.scheduler.max_num_seqs,
            max_waiting_requests=config.scheduler.max_waiting_requests)
        self._seq_ids = itertools.count()
        self.output_processor = OutputProcessor(self.scheduler, self.eos_token_ids,
                                                self.max_model_len, self._seq_ids)
        self._groups: dict[str, SequenceGroup] = {}
        self._window = StepWindow(config.scheduler.async_scheduling)
        self.step_observer: StepObserver | None = None
        self._num_rebuilds_in_a_row = 0
        self._num_worker_rebuilds = 0
        self.last_scheduled: ScheduledStep | None = None
        self.stat_loggers: list[StatLogger] = []
        self._totals = StepTotals()
        self._drain_rate = DrainRate()  # finished requests: a full queue's Retry-After
        self._last_finished: tuple[float, SentStep] | None = None  # (perf_counter, step)

    def _load_model(self) -> None:
        infos = self._on_all_workers(lambda w: w.load_model())
        if [info.rank for info in infos] != list(range(len(infos))):
            raise ConfigError(f"the workers report ranks {[info.rank for info in infos]}; list "
                              "them in rank order (0, 1, ...)")
        self.worker_info = infos[0]
        self.max_model_len = min(info.max_model_len for info in infos)
        if self.config.model.max_model_len:
            self.max_model_len = min(self.max_model_len, self.config.model.max_model_len)
        self.vocab_size = self.worker_info.vocab_size
        self.eos_token_ids = list(self.worker_info.eos_token_ids)

    def _allocate_cache(self) -> None:
        """As many blocks as the tightest worker has room for, then each worker's warm-up."""
        profiles = self._on_all_workers(lambda w: w.profile_memory())
        cache = self.config.cache
        self.num_gpu_blocks = cache.num_gpu_blocks_override or min(
            p.num_gpu_blocks for p in profiles)
        self.num_cpu_blocks = (cache.num_cpu_blocks_override if cache.num_cpu_blocks_override >= 0
                               else min(p.num_cpu_blocks for p in profiles))
        bytes_per_block = max(p.kv_bytes_per_block for p in profiles)
        self.kv_bytes_per_block = sum(p.kv_bytes_per_block for p in profiles)  # every rank's
        self.num_offload_blocks = (int(cache.kv_offload_gib * GiB // bytes_per_block)
                                   if bytes_per_block else 0)
        if self.num_gpu_blocks < 1:
            raise ConfigError(f"no room for KV-cache blocks on the device "
                              f"(num_gpu_blocks={self.num_gpu_blocks}); lower the model size or "
                              f"raise gpu_memory_utilization / kv_cache_memory_gib")
        self._on_all_workers(lambda w: w.init_cache(
            self.num_gpu_blocks, self.num_cpu_blocks + self.num_offload_blocks,
            self.scheduler_epoch))
        self._on_all_workers(lambda w: w.warm_up())
        logger.info("engine ready: %d GPU blocks, %d CPU swap blocks, %d host-tier blocks of %d "
                    "tokens, max_model_len=%d", self.num_gpu_blocks, self.num_cpu_blocks,
                    self.num_offload_blocks, cache.block_size, self.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None,
                    owner: str = "", resumed: dict[int, list[int]] | None = None,
                    is_pooling: bool = False) -> None:
        """`resumed`: output index → the tokens it already produced elsewhere (a gateway's
        failover); only those indices run, each continuing where it stopped. `is_pooling`: an
        embedding request, its prompt computed and pooled (ModelConfig.pooling_type), nothing
        generated; it reports RequestOutput.embedding and finishes."""
        if request_id in self._groups:
            raise InvalidRequest(f"request_id {request_id!r} is already in use",
                                 reason=Reason.REQUEST_ID_IN_USE, field="request_id")
        check_request(request_id, prompt_token_ids, sampling, priority, self._limits)
        if is_pooling and (sampling.num_candidates != 1 or resumed):
            raise InvalidRequest(f"an embedding request runs one sequence over its prompt, got "
                                 f"n={sampling.n}, best_of={sampling.num_candidates} and "
                                 f"{len(resumed or {})} resumed outputs", field="sampling.n")
        if resumed:
            check_resumed_outputs(len(prompt_token_ids), sampling, resumed, self._limits)
            group = SequenceGroup.from_resumed(request_id, list(prompt_token_ids), sampling,
                                               resumed, self._seq_ids, priority, arrival_time)
        else:
            group = SequenceGroup.from_prompt(request_id, list(prompt_token_ids), sampling,
                                              next(self._seq_ids), priority, arrival_time)
        group.owner = owner
        if is_pooling:
            group.pooling_type = self.config.model.pooling_type
        self._groups[request_id] = group
        self.scheduler.add_group(group)

    def prepare_grammars(self, sampling: SamplingParams) -> Future[None] | None:
        """A constrained request's grammar, compiled by the rank that samples before the request
        is added (vLLM holds such a request back until its grammar is compiled too), so no step
        waits for a compile; None: unconstrained. Any thread may call this. A worker rebuilt
        later has lost the grammars: its first steps compile what they lack, and wait for it."""
        if sampling.structured_outputs is None:
            return None
        return self.workers[0].prepare_grammars([sampling.structured_outputs])

    def check_admission(self, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        check_admission(prompt_token_ids, sampling, self._limits, len(self.scheduler.waiting),
                        self._drain_rate.wait_s)

    def abort_request(self, request_id: str, owner: str | None = None) -> RequestOutput:
        """A request of another `owner` (None: an admin's abort) raises the same NotFound as an
        unknown one, so request ids leak nothing."""
        group = self._owned_group(request_id, owner)
        del self._groups[request_id]
        self.scheduler.finish_group(group, FinishReason.ABORT)
        self._record_finished(group)
        report = make_request_output(group)
        assert report is not None, "a newly finished group always reports"
        return report

    def pause_request(self, request_id: str, owner: str | None = None) -> None:
        """The request's consumer is behind: it is not scheduled until resume_request, keeping its
        place, tokens and (unless preempted, as paused groups are first) its KV blocks. NotFound
        as abort_request."""
        self._owned_group(request_id, owner).is_paused = True

    def resume_request(self, request_id: str, owner: str | None = None) -> None:
        """Runnable again, continuing exactly where it stopped."""
        self._owned_group(request_id, owner).is_paused = False

    def _owned_group(self, request_id: str, owner: str | None) -> SequenceGroup:
        group = self._groups.get(request_id)
        if group is None or (owner is not None and owner != group.owner):
            raise NotFound(f"request_id {request_id!r} is not running",
                           reason=Reason.REQUEST_NOT_FOUND, field="request_id")
        return group

    def finish_sequence(self, request_id: str, index: int, owner: str | None = None
                        ) -> RequestOutput | None:
        """Output `index` ends with STOP now (its caller matched a stop string in its text): it
        is scheduled no more and its blocks are freed while its siblings go on. Returns the
        report if that ended the request. NotFound as abort_request, and for an index that is
        not running; InvalidRequest for beam search and best_of > n, whose candidates are ranked
        only at the end (their caller sees no output before)."""
        group = self._owned_group(request_id, owner)
        if not group.is_streamed:
            raise InvalidRequest(f"request_id {request_id!r} uses beam search or best_of > n; "
                                 "its outputs cannot be finished one by one", field="index")
        seqs = [s for s in group.seqs if s.index == index and not s.is_finished]
        if not seqs:
            raise NotFound(f"request_id {request_id!r} has no running output index {index}",
                           reason=Reason.REQUEST_NOT_FOUND, field="index")
        seqs[0].finish(FinishReason.STOP)
        self.scheduler.free_finished(group)
        if not group.is_finished:
            return None
        del self._groups[request_id]
        self._record_finished(group)
        return make_request_output(group)

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def has_runnable_requests(self) -> bool:
        """Unfinished and not every one paused."""
        return self.scheduler.has_runnable()

    def get_load(self) -> EngineLoad:
        bm = self.block_manager
        return EngineLoad(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped),
            num_gpu_blocks_used=bm.num_gpu_blocks - bm.num_free_gpu_blocks,
            num_gpu_blocks=bm.num_gpu_blocks,
            num_cpu_blocks_used=bm.num_cpu_blocks - bm.num_free_cpu_blocks,
            num_cpu_blocks=bm.num_cpu_blocks, prefix_cache_hit_rate=bm.prefix_cache_hit_rate,
            num_preemptions=self.scheduler.num_preemptions,
            num_worker_rebuilds=self._num_worker_rebuilds,
            num_paused=self.scheduler.num_paused)

    def step(self, has_queued_operations: Callable[[], bool] | None = None
             ) -> list[RequestOutput]:
        """A failed step finishes the requests it touched, and those of the step sent after it,
        with finish_reason "error"; every other request keeps running. A worker that lost its
        KV cache is rebuilt instead and every request recomputed.

        `has_queued_operations` is asked once step n's tokens are in: True holds step n+2 back
        to the next call, so what the caller queued while step n ran (a request, an abort, a
        pause) is in its plan, not behind it; step n+1 already runs meanwhile."""
        outputs: list[RequestOutput] = []
        self._window.fill(lambda: self._schedule(outputs))
        step = self._window.pop_oldest()
        if step is None:
            self._last_finished = None
        if step is not None:
            outputs += self._finish(
                step, send_behind=lambda: not (has_queued_operations and has_queued_operations()))
        self._forget_finished(outputs)
        return outputs

    @property
    def has_step_in_flight(self) -> bool:
        return bool(self._window)

    def drain(self) -> list[RequestOutput]:
        """Process the steps in flight without sending another: the workers are idle after."""
        outputs: list[RequestOutput] = []
        while (step := self._window.pop_oldest()) is not None:
            outputs += self._finish(step)
        self._forget_finished(outputs)
        return outputs

    def _forget_finished(self, outputs: list[RequestOutput]) -> None:
        for report in outputs:
            if report.finished:
                group = self._groups.pop(report.request_id, None)
                if group is not None:
                    self._record_finished(group)

    def totals(self) -> StepTotals:
        bm = self.block_manager
        return StepTotals(self.output_processor.num_prompt_tokens,
                          self.output_processor.num_generation_tokens,
                          self.scheduler.num_preemptions, bm.prefix_cache_queries,
                          bm.prefix_cache_hits,
                          bm.host_tier.num_hit_tokens if bm.host_tier is not None else 0)

    def _host_time_s(self, step: SentStep, timings: StepTimings) -> float | None:
        """For a step sent once the one before had finished: the time between their ends less
        the worker's, i.e. the host's time per step that no device work overlapped (reports,
        scheduling, transport). None for a step sent behind another, or after an idle engine."""
        now = time.perf_counter()
        previous, self._last_finished = self._last_finished, (now, step)
        if previous is None or previous[1].is_advanced:
            return None
        worker_ns = (timings.cache_ops_ns + timings.prepare_ns + timings.forward_ns
                     + timings.sample_ns + timings.draft_ns + timings.draft_catch_up_ns)
        return max(0.0, now - previous[0] - worker_ns * 1e-9)

    def _record_step(self, step: SentStep, timings: StepTimings, process_time_s: float) -> None:
        if not self.stat_loggers:
            return
        totals, before = self.totals(), self._totals
        self._totals = totals
        scheduled = step.scheduled
        plan = scheduled.plan
        num_swapped_in, num_swapped_out = len(plan.blocks_to_swap_in), len(plan.blocks_to_swap_out)
        stats = StepStats.between(
            before, totals, plan.num_scheduled_tokens,
            num_swapped_in - scheduled.num_blocks_onloaded,
            num_swapped_out - scheduled.num_blocks_offloaded,
            step.schedule_time_s + process_time_s, scheduled.num_blocks_offloaded,
            scheduled.num_blocks_onloaded, HostCopyStats.of(
                scheduled.num_blocks_offloaded, num_swapped_out, scheduled.num_blocks_onloaded,
                num_swapped_in, self.kv_bytes_per_block, timings))
        for stat_logger in self.stat_loggers:
            stat_logger.record_step(stats)

    def _record_finished(self, group: SequenceGroup) -> None:
        self._drain_rate.record()
        if not self.stat_loggers:
            return
        stats = FinishedRequestStats.of(
            group.seqs[0].finish_reason or FinishReason.ABORT, group.arrival_time,
            group.first_scheduled_time, group.first_token_time, time.monotonic(),
            _num_generation_tokens(group), group.sampling.n, group.sampling.max_tokens)
        for stat_logger in self.stat_loggers:
            stat_logger.record_finished(stats)

    def _schedule(self, outputs: list[RequestOutput]) -> SentStep | None:
        """None: nothing to run. Rejected requests' reports go to `outputs`."""
        start = time.perf_counter()
        scheduled = self.scheduler.schedule()
        schedule_time_s = time.perf_counter() - start
        outputs += [r for g in scheduled.rejected if (r := make_request_output(g)) is not None]
        plan = scheduled.plan
        if plan is None:
            return None
        if self.step_observer is None:
            return SentStep(scheduled, [_submit(w, plan) for w in self.workers],
                            schedule_time_s=schedule_time_s)
        with self.step_observer.step_sent(scheduled) as handle:
            return SentStep(scheduled, [_submit(w, plan) for w in self.workers], handle=handle,
                            schedule_time_s=schedule_time_s)

    def _finish(self, step: SentStep, send_behind: Callable[[], bool] | None = None
                ) -> list[RequestOutput]:
        """`send_behind` is asked once the step's tokens are in: True sends the step behind the
        next one before the reports are built."""
        try:
            step_output = step.result()
        except Exception as exc:  # any worker failure: the engine keeps serving
            return self._fail_steps(step, exc)
        self.last_scheduled = step.scheduled
        self._num_rebuilds_in_a_row = 0
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.record_step(step.scheduled.scheduled, step_output.timings,
                                                  self._host_time_s(step, step_output.timings))
        start = time.perf_counter()
        step.take_in()
        groups = self.output_processor.apply(step.scheduled, step_output)
        process_time_s = time.perf_counter() - start
        outputs: list[RequestOutput] = []
        if send_behind is not None and send_behind():
            self._window.send_behind(lambda: self._schedule(outputs))
        start = time.perf_counter()
        outputs += self.output_processor.report(groups)
        self._record_step(step, step_output.timings, process_time_s + time.perf_counter() - start)
        self._step_done(step, outputs)
        return outputs

    def _step_done(self, step: SentStep, outputs: list[RequestOutput]) -> None:
        if self.step_observer is not None:
            self.step_observer.step_done(step.handle, step.scheduled, outputs)

    def _fail_steps(self, failed: SentStep, exc: Exception) -> list[RequestOutput]:
        """clear_state stays in the same epoch (only a handshake moves a worker to another);
        step ids keep growing, so no step sent before can follow one sent after."""
        steps = self._window.fail(failed)
        for step in steps:
            scheduled, plan = step.scheduled, step.scheduled.plan
            num_swap_outs = len(plan.blocks_to_swap_out) - scheduled.num_blocks_offloaded
            self.block_manager.forget_host_copies(
                plan.blocks_to_swap_out[num_swap_outs:],
                plan.blocks_to_swap_in[:scheduled.num_blocks_onloaded])
        step_ids = ", ".join(str(s.scheduled.plan.step_id) for s in steps)
        logger.error("step %s failed: %r", step_ids, exc, exc_info=exc)
        message = f"engine step {failed.scheduled.plan.step_id} failed: {exc}"
        lost = [worker for worker in self.workers if not self._clear_state(worker)]
        if not lost:
            outputs = self._finish_groups(_touched_groups(steps), FinishReason.ERROR, message)
        else:
            outputs = self._rebuild(lost, steps, message)
        self.scheduler.forget_worker_state()
        for step in steps:
            self._step_done(step, outputs)
        return outputs

    def _clear_state(self, worker: WorkerHandle) -> bool:
        try:
            worker.clear_state(self.scheduler_epoch)
            return True
        except Exception as exc:
            logger.warning("clear_state failed on a worker: %r", exc)
            return False

    def _rebuild(self, lost: list[WorkerHandle], steps: list[SentStep],
                 message: str) -> list[RequestOutput]:
        """No accepted request is lost to a worker crash -- unless the workers were lost
        MAX_REBUILDS_IN_A_ROW times in a row: the failed steps' requests may be the cause."""
        self._num_rebuilds_in_a_row += 1
        outputs: list[RequestOutput] = []
        if self._num_rebuilds_in_a_row >= MAX_REBUILDS_IN_A_ROW:
            outputs += self._finish_groups(
                _touched_groups(steps), FinishReason.ERROR,
                f"{message} (workers lost {self._num_rebuilds_in_a_row} times in a row)")
        num_requeued = self.scheduler.recompute_all()
        logger.warning("%d worker(s) lost their KV cache; rebuilding them, then recomputing %d "
                       "requests (scheduler epoch %d)", len(lost), num_requeued,
                       self.scheduler_epoch)
        try:
            # at once: the tensor-parallel ranks' warm-up forwards meet in their all-reduces
            self._on_workers(self._handshake_again, lost)
        except Exception as exc:
            logger.error("a lost worker was not rebuilt: %r", exc)
            live = [g for g in self._groups.values() if not g.is_finished]
            outputs += self._finish_groups(live, FinishReason.ERROR,
                                           f"{message}; the worker was not rebuilt: {exc}")
        return outputs

    def _handshake_again(self, worker: WorkerHandle) -> None:
        info = worker.load_model()
        if _shape(info) != _shape(self.worker_info) or info.max_model_len < self.max_model_len:
            raise ConfigError(f"the restarted worker serves another model: {info}, "
                              f"the engine was built for {self.worker_info}")
        worker.init_cache(self.num_gpu_blocks, self.num_cpu_blocks + self.num_offload_blocks,
                          self.scheduler_epoch)
        worker.warm_up()
        self._num_worker_rebuilds += 1
        logger.info("worker rebuilt: %d GPU blocks, %d CPU blocks (scheduler epoch %d)",
                    self.num_gpu_blocks, self.num_cpu_blocks, self.scheduler_epoch)

    def _finish_groups(self, groups: list[SequenceGroup], reason: FinishReason,
                       message: str) -> list[RequestOutput]:
        for group in groups:
            if not group.is_finished:
                self.scheduler.finish_group(group, reason, message)
        return [r for g in groups if (r := make_request_output(g)) is not None]

    def _on_all_workers(self, call):
        return self._on_workers(call, self.workers)

    def _on_workers(self, call, workers: list[WorkerHandle]):
        if self._pool is None or len(workers) == 1:
            return [call(worker) for worker in workers]
        # a copy of this thread's context keeps the step span the parent of each ExecuteStep
        contexts = [contextvars.copy_context() for _ in workers]
        return list(self._pool.map(lambda ctx, w: ctx.run(call, w), contexts, workers))


def _num_generation_tokens(group: SequenceGroup) -> int:
    """Of the group's longest output (beam search: of its longest finished beam too)."""
    return max([s.num_output_tokens for s in group.seqs]
               + [len(h.token_ids) for h in group.beam_hypotheses])


def _touched_groups(steps: list[SentStep]) -> list[SequenceGroup]:
    """Swapped-out groups too: a failed swap-out may have lost their KV."""
    groups: dict[int, SequenceGroup] = {}
    for step in steps:
        groups.update((id(item.group), item.group) for item in step.scheduled.scheduled)
        groups.update((id(g), g) for g in step.scheduled.swapped_out)
    return list(groups.values())


def _shape(info: WorkerInfo) -> tuple:
    return (info.architecture, info.vocab_size, info.num_layers, info.num_kv_heads,
            info.head_size, info.dtype)


def _submit(worker: WorkerHandle, plan: StepPlan) -> StepFuture:
    """A call that fails at once fails its future instead."""
    try:
        return worker.submit_step(plan)
    except Exception as exc:
        failed: Future[StepOutput] = Future()
        failed.set_exception(exc)
        return failed
