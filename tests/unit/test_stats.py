"""The engine's stats: step differences, request phases, vLLM's periodic stats line, and the JSON
log lines that carry the current span's ids."""

import json
import logging

import pytest
from opentelemetry.sdk.trace import TracerProvider
from pagedserve.scheduler_svc.stats import (
    FinishedRequestStats,
    LoggingStatLogger,
    StepStats,
    StepTotals,
)
from pagedserve.services.common.engine_api import EngineLoad

from pagedserve.log_format import JsonFormatter


def load(num_running=0, num_waiting=0, num_gpu_blocks_used=0) -> EngineLoad:
    return EngineLoad(num_running=num_running, num_waiting=num_waiting, num_swapped=0,
                      num_gpu_blocks_used=num_gpu_blocks_used, num_gpu_blocks=40,
                      num_cpu_blocks_used=0, num_cpu_blocks=8, prefix_cache_hit_rate=0.0,
                      num_preemptions=0, num_worker_rebuilds=0)


def step(num_prompt_tokens=0, num_generation_tokens=0, queries=0, hits=0) -> StepStats:
    return StepStats.between(StepTotals(), StepTotals(num_prompt_tokens, num_generation_tokens,
                                                      0, queries, hits), 8, 0, 0, 0.001)


def test_a_step_is_the_difference_of_two_totals():
    stats = StepStats.between(StepTotals(10, 5, 1, 100, 30), StepTotals(17, 9, 3, 116, 46),
                              num_scheduled_tokens=11, num_blocks_swapped_in=2,
                              num_blocks_swapped_out=0, schedule_time_s=0.002)
    assert (stats.num_prompt_tokens, stats.num_generation_tokens, stats.num_preemptions,
            stats.num_prefix_cache_queries, stats.num_prefix_cache_hits) == (7, 4, 2, 16, 16)
    assert (stats.num_scheduled_tokens, stats.num_blocks_swapped_in) == (11, 2)


def test_request_phases_end_when_the_request_did():
    done = FinishedRequestStats.of("length", 10.0, 10.5, 11.0, 14.0)
    assert (done.queue_time_s, done.prefill_time_s, done.decode_time_s) == (0.5, 0.5, 3.0)
    waited = FinishedRequestStats.of("abort", 10.0, None, None, 12.0)
    assert (waited.queue_time_s, waited.prefill_time_s, waited.decode_time_s) == (2.0, 0.0, 0.0)


def test_the_stats_line_reports_the_interval_and_stays_quiet_while_idle(caplog):
    stat_line = LoggingStatLogger()
    assert stat_line.log(load()) is None  # idle from the start: nothing
    stat_line.record_step(step(num_prompt_tokens=100, num_generation_tokens=20, queries=64,
                               hits=16))
    with caplog.at_level(logging.INFO, logger="pagedserve.scheduler_svc.stats"):
        line = stat_line.log(load(num_running=2, num_waiting=1, num_gpu_blocks_used=10))
    assert line in caplog.messages
    assert "Avg prompt throughput: " in line and "Avg generation throughput: " in line
    assert "Running: 2 reqs, Waiting: 1 reqs, Swapped: 0 reqs" in line
    assert "GPU KV cache usage: 25.0%" in line and "Prefix cache hit rate: 25.0%" in line
    # the counts restart with each line: one line when the engine falls idle, then silence
    assert "Avg generation throughput: 0.0 tokens/s" in stat_line.log(load())
    assert stat_line.log(load()) is None


@pytest.mark.parametrize("is_traced", [False, True])
def test_json_log_lines_carry_the_current_span(is_traced):
    record = logging.LogRecord("pagedserve.x", logging.WARNING, __file__, 1, "step %d late",
                               (7,), None)
    formatter = JsonFormatter("scheduler")
    if is_traced:
        with TracerProvider().get_tracer("t").start_as_current_span("s") as span:
            entry = json.loads(formatter.format(record))
        context = span.get_span_context()
        assert entry["trace_id"] == format(context.trace_id, "032x")
        assert entry["span_id"] == format(context.span_id, "016x")
    else:
        entry = json.loads(formatter.format(record))
        assert "trace_id" not in entry and "span_id" not in entry
    assert (entry["level"], entry["service"], entry["logger"], entry["message"]) == (
        "WARNING", "scheduler", "pagedserve.x", "step 7 late")
