"""What a scheduler is asked (SubmitRequest) and what it reports of itself (EngineLoad): plain
types shared by the scheduler core, its servicer and the gateway's client."""

from __future__ import annotations

import time
from dataclasses import dataclass

from pagedserve.services.common.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class SubmitRequest:
    """One request as the scheduler service receives it (the twin of SubmitRequest)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    priority: int = 0
    arrival_time_s: float = 0.0  # the gateway's wall clock (Unix seconds); 0 = on receipt

    def arrival_time_monotonic(self) -> float | None:
        """The arrival on this process's monotonic clock (the engine's FCFS key); None = now."""
        if self.arrival_time_s <= 0.0:
            return None
        return time.monotonic() - max(0.0, time.time() - self.arrival_time_s)


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
    num_worker_rebuilds: int  # workers rebuilt after losing their KV cache, since start
