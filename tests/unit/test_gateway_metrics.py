"""The gateway's metrics: calls counted by the status code they end with, admission refusals,
and a request's latencies and lengths."""

import asyncio

import pytest
from pagedserve.services.common.errors import InvalidRequest, Overloaded
from pagedserve.services.common.outputs import Usage
from pagedserve.services.gateway.metrics import GatewayMetrics
from pagedserve.services.rpc.metrics import tokens_buckets
from prometheus_client import CollectorRegistry


def sample(registry: CollectorRegistry, name: str, **labels) -> float:
    return registry.get_sample_value(name, {"model_name": "m", **labels}) or 0.0


@pytest.fixture()
def registry():
    return CollectorRegistry()


@pytest.mark.parametrize(("error", "code", "num_rejections"), [
    (None, "OK", 0),
    (Overloaded("100 requests in flight"), "RESOURCE_EXHAUSTED", 1),
    (InvalidRequest("max_tokens must be >= 1"), "INVALID_ARGUMENT", 0),
    (asyncio.CancelledError(), "CANCELLED", 0),
])
def test_calls_are_counted_by_status_code_and_refusals_by_admission(registry, error, code,
                                                                     num_rejections):
    metrics = GatewayMetrics(registry, "m", 2048)
    if error is None:
        with metrics.track("GenerateStream"):
            pass
    else:
        with pytest.raises(type(error)), metrics.track("GenerateStream"):
            raise error
    assert sample(registry, "pagedserve:gateway_requests_total", method="GenerateStream",
                  code=code) == 1
    assert sample(registry, "pagedserve:admission_rejections_total") == num_rejections


def test_a_request_observes_ttft_each_gap_and_its_lengths(registry):
    metrics = GatewayMetrics(registry, "m", 2048)
    timer = metrics.start_request()
    for _ in range(4):
        timer.on_tokens()
    timer.finished(Usage(prompt_tokens=7, completion_tokens=4))
    assert sample(registry, "vllm:time_to_first_token_seconds_count") == 1
    assert sample(registry, "vllm:inter_token_latency_seconds_count") == 3
    assert sample(registry, "vllm:e2e_request_latency_seconds_count") == 1
    assert sample(registry, "vllm:request_prompt_tokens_sum") == 7
    assert sample(registry, "vllm:request_generation_tokens_bucket", le="5.0") == 1
    assert sample(registry, "vllm:request_generation_tokens_bucket", le="2.0") == 0


def test_length_buckets_are_vllms_1_2_5_series_up_to_max_model_len():
    assert tokens_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert tokens_buckets(2048)[-1] == 2000


def test_constrained_requests_are_counted_by_kind(registry):
    metrics = GatewayMetrics(registry, "m", 2048)
    metrics.record_structured_output("json_schema")
    metrics.record_structured_output("json_schema")
    metrics.record_structured_output("regex")
    count = registry.get_sample_value
    assert count("pagedserve:structured_output_requests_total",
                 {"model_name": "m", "kind": "json_schema"}) == 2
    assert count("pagedserve:structured_output_requests_total",
                 {"model_name": "m", "kind": "regex"}) == 1
