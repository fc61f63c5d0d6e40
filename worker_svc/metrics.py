"""The worker's Prometheus metrics: where each engine step's time went (the timings the worker
measures anyway) and the KV-cache blocks it swapped, recorded once per step."""

from __future__ import annotations

from pagedserve.services.common.step_plan import StepPlan, StepTimings
from pagedserve.services.rpc.metrics import STEP_TIME_BUCKETS
from prometheus_client import CollectorRegistry, Counter, Histogram

PHASES = ("cache_ops", "prepare", "forward", "sample")  # StepTimings' fields, without _ns


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, rank: int) -> None:
        labels = ["model_name", "rank"]
        step_time = Histogram("pagedserve:worker_step_time_seconds",
                              "Worker time per engine step, by phase.", [*labels, "phase"],
                              registry=registry, buckets=STEP_TIME_BUCKETS)
        self._phases = [(f"{phase}_ns", step_time.labels(model_name, str(rank), phase))
                        for phase in PHASES]
        swapped = Counter("pagedserve:worker_swapped_blocks", "KV-cache blocks copied between "
                          "the device and CPU swap space.", [*labels, "direction"],
                          registry=registry)
        self._swapped_in = swapped.labels(model_name, str(rank), "in")
        self._swapped_out = swapped.labels(model_name, str(rank), "out")
        self.grammar_compile_time = Histogram(
            "pagedserve:structured_output_compile_time_seconds", "Time to compile one "
            "structured-output constraint for the vocabulary (once per distinct constraint).",
            labels, registry=registry, buckets=STEP_TIME_BUCKETS).labels(model_name, str(rank))
        self.grammar_mask_time = Histogram(
            "pagedserve:structured_output_mask_time_seconds", "Time a step's sampling waits for "
            "the token bitmask of its constrained sequences: the rows built ahead, once the "
            "step before was on the host, and those built then (steps without any are not "
            "counted).",
            labels, registry=registry, buckets=STEP_TIME_BUCKETS).labels(model_name, str(rank))

    def record_step(self, plan: StepPlan, timings: StepTimings) -> None:
        for field, histogram in self._phases:
            histogram.observe(getattr(timings, field) / 1e9)
        if timings.mask_ns:  # a step with constrained rows
            self.grammar_mask_time.observe(timings.mask_ns / 1e9)
        if plan.blocks_to_swap_in:
            self._swapped_in.inc(len(plan.blocks_to_swap_in))
        if plan.blocks_to_swap_out:
            self._swapped_out.inc(len(plan.blocks_to_swap_out))
