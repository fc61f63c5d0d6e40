"""Engine statistics for the stat loggers: what each processed step did and where each finished
request spent its time. A step is the difference between two sets of counters the engine keeps
anyway, so it costs a few subtractions."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from pagedserve.services.common.engine_api import EngineLoad
from pagedserve.services.common.step_plan import StepTimings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepTotals:
    num_prompt_tokens: int = 0  # of the prompts that got their first token
    num_generation_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    num_prefix_cache_hits: int = 0  # among them, tokens whose KV was reused
    num_host_cache_hits: int = 0  # among those, tokens copied back from the host tier


@dataclass(frozen=True, slots=True)
class HostCopyStats:
    """A step's host-tier copies: their bytes, and their time as the worker measured it. The
    worker times a step's swap-out (swap-in) as a whole, preemption swaps included; the tier's
    blocks get their share of it (every block moves the same bytes)."""

    offload_bytes: int = 0
    onload_bytes: int = 0
    offload_time_s: float = 0.0
    onload_time_s: float = 0.0

    @classmethod
    def of(cls, num_offloaded: int, num_swapped_out: int, num_onloaded: int,
           num_swapped_in: int, bytes_per_block: int, timings: StepTimings) -> HostCopyStats:
        """`num_swapped_*`: every block the step swapped that way, the tier's included."""
        return cls(num_offloaded * bytes_per_block, num_onloaded * bytes_per_block,
                   _share(timings.swap_out_ns, num_offloaded, num_swapped_out),
                   _share(timings.swap_in_ns, num_onloaded, num_swapped_in))


def _share(time_ns: int, num_blocks: int, num_all_blocks: int) -> float:
    return time_ns * 1e-9 * num_blocks / num_all_blocks if num_blocks else 0.0


@dataclass(frozen=True, slots=True)
class StepStats:
    num_scheduled_tokens: int
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_prefix_cache_queries: int
    num_prefix_cache_hits: int
    num_blocks_swapped_in: int
    num_blocks_swapped_out: int
    schedule_time_s: float  # the scheduler's own time: schedule() and output processing
    num_host_cache_hits: int = 0
    num_blocks_offloaded: int = 0  # to the host tier; not among the swapped blocks
    num_blocks_onloaded: int = 0
    host_copies: HostCopyStats = HostCopyStats()

    @classmethod
    def between(cls, before: StepTotals, after: StepTotals, num_scheduled_tokens: int,
                num_blocks_swapped_in: int, num_blocks_swapped_out: int,
                schedule_time_s: float, num_blocks_offloaded: int = 0,
                num_blocks_onloaded: int = 0,
                host_copies: HostCopyStats = HostCopyStats()) -> StepStats:
        return cls(num_scheduled_tokens,
                   after.num_prompt_tokens - before.num_prompt_tokens,
                   after.num_generation_tokens - before.num_generation_tokens,
                   after.num_preemptions - before.num_preemptions,
                   after.num_prefix_cache_queries - before.num_prefix_cache_queries,
                   after.num_prefix_cache_hits - before.num_prefix_cache_hits,
                   num_blocks_swapped_in, num_blocks_swapped_out, schedule_time_s,
                   after.num_host_cache_hits - before.num_host_cache_hits,
                   num_blocks_offloaded, num_blocks_onloaded, host_copies)


@dataclass(frozen=True, slots=True)
class FinishedRequestStats:
    finish_reason: str  # "stop", "length", "abort", "error"
    queue_time_s: float  # arrival -> first scheduled
    prefill_time_s: float  # first scheduled -> first token
    decode_time_s: float  # first token -> finished
    num_generation_tokens: int = 0  # of its longest output
    n: int = 1  # the request's sampling parameters
    max_tokens: int = 0

    @property
    def inference_time_s(self) -> float:
        """First scheduled -> finished: prefill and decode."""
        return self.prefill_time_s + self.decode_time_s

    @property
    def time_per_output_token_s(self) -> float:
        """vLLM's: the decode time over the tokens after the first (0 for one token)."""
        if self.num_generation_tokens < 2:
            return 0.0
        return self.decode_time_s / (self.num_generation_tokens - 1)

    @classmethod
    def of(cls, finish_reason: str, arrival_time: float, first_scheduled_time: float | None,
           first_token_time: float | None, now: float, num_generation_tokens: int = 0,
           n: int = 1, max_tokens: int = 0) -> FinishedRequestStats:
        """A phase never reached ends when the request did."""
        scheduled = now if first_scheduled_time is None else first_scheduled_time
        first_token = now if first_token_time is None else first_token_time
        return cls(finish_reason, max(0.0, scheduled - arrival_time),
                   max(0.0, first_token - scheduled), max(0.0, now - first_token),
                   num_generation_tokens, n, max_tokens)


class StatLogger(Protocol):
    """Never called twice at once."""

    def record_step(self, stats: StepStats) -> None: ...
    def record_finished(self, stats: FinishedRequestStats) -> None: ...


class LoggingStatLogger:
    """vLLM's periodic stats line. `log` runs on another thread than `record_step`."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._since = time.monotonic()
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        self._num_queries = 0
        self._num_hits = 0
        self._was_idle = True

    def record_step(self, stats: StepStats) -> None:
        with self._lock:
            self._num_prompt_tokens += stats.num_prompt_tokens
            self._num_generation_tokens += stats.num_generation_tokens
            self._num_queries += stats.num_prefix_cache_queries
            self._num_hits += stats.num_prefix_cache_hits

    def record_finished(self, stats: FinishedRequestStats) -> None:
        pass

    def log(self, load: EngineLoad) -> str | None:
        now = time.monotonic()
        with self._lock:
            elapsed_s = max(now - self._since, 1e-9)
            prompt, generation = self._num_prompt_tokens, self._num_generation_tokens
            queries, hits = self._num_queries, self._num_hits
            self._since = now
            self._num_prompt_tokens = self._num_generation_tokens = 0
            self._num_queries = self._num_hits = 0
        is_idle = not (prompt or generation or load.num_running or load.num_waiting
                       or load.num_swapped)
        if is_idle and self._was_idle:
            return None
        self._was_idle = is_idle
        usage = load.num_gpu_blocks_used / load.num_gpu_blocks if load.num_gpu_blocks else 0.0
        line = (f"Avg prompt throughput: {prompt / elapsed_s:.1f} tokens/s, "
                f"Avg generation throughput: {generation / elapsed_s:.1f} tokens/s, "
                f"Running: {load.num_running} reqs, Waiting: {load.num_waiting} reqs, "
                f"Swapped: {load.num_swapped} reqs, GPU KV cache usage: {usage:.1%}, "
                f"Prefix cache hit rate: {hits / queries if queries else 0.0:.1%}")
        logger.info("%s", line)
        return line
