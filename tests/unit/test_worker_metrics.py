"""The worker's Prometheus metrics from each step's timings."""

from __future__ import annotations

from pagedserve.services.common.step_plan import StepPlan, StepTimings
from pagedserve.worker_svc.metrics import WorkerMetrics
from prometheus_client import CollectorRegistry

MASK_TIME = "pagedserve:structured_output_mask_time_seconds"


def test_the_mask_wait_is_counted_for_steps_with_constrained_rows_only():
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry, "tiny", 0)
    labels = {"model_name": "tiny", "rank": "0"}
    metrics.record_step(StepPlan(1, 1), StepTimings(sample_ns=4_000_000))
    metrics.record_step(StepPlan(1, 2), StepTimings(sample_ns=4_000_000, mask_ns=3_000_000))
    assert registry.get_sample_value(f"{MASK_TIME}_count", labels) == 1
    assert registry.get_sample_value(f"{MASK_TIME}_sum", labels) == 0.003
