"""Each service's /metrics, scraped with Prometheus's own text parser before and after real
requests through the three services (one process, real gRPC): counters move by what the requests
did, gauges fall back to zero when the engine is idle, histograms observe."""

import dataclasses
import logging
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from pagedserve.services.common.config import CacheConfig
from pagedserve.services.rpc.v1 import common_pb2, gateway_pb2
from pagedserve.services.text.tokenizer import Tokenizer
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import assert_idle

NUM_GPU_BLOCKS = 16  # of 16 tokens: four 80-token requests do not fit side by side
SERVED = "served-tiny"  # --served-model-name, set on the engine; the gateway learns it there


@pytest.fixture(scope="module")
def stack_config(stack_config):
    return dataclasses.replace(
        stack_config, model=dataclasses.replace(stack_config.model, served_model_name=SERVED),
        cache=CacheConfig(kv_cache_memory_gib=0.01, swap_space_gib=0.01,
                          num_gpu_blocks_override=NUM_GPU_BLOCKS))


@pytest.fixture(scope="module")
def stack_options():
    return {"metrics_port": 0, "stats_interval_s": 0.2}


def scrape(stack, service: str) -> list:
    port = stack.metrics_ports()[service]
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return [sample for family in text_string_to_metric_families(text)
            for sample in family.samples]


def value(samples, name: str, **labels) -> float:
    """The sum of the samples named `name` whose labels include `labels`."""
    return sum(s.value for s in samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def request(prompt: list[int], max_tokens: int) -> gateway_pb2.GenerateRequest:
    return gateway_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(token_ids=prompt),
        sampling=common_pb2.SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                           ignore_eos=True))


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "the metrics never got there"
        time.sleep(0.05)


def test_every_service_serves_its_metrics_with_vllm_names(stack):
    names = {service: {s.name for s in scrape(stack, service)}
             for service in ("worker", "scheduler", "gateway")}
    assert {"vllm:num_requests_running", "vllm:num_requests_waiting",
            "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc",
            "pagedserve:worker_rebuilds_total", "pagedserve:num_requests_paused"
            } <= names["scheduler"]
    assert {"vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:request_prompt_tokens_sum"} <= names["gateway"]
    assert "pagedserve:worker_step_time_seconds_count" in names["worker"]
    for service in ("worker", "scheduler", "gateway"):
        labels = {s.labels.get("model_name") for s in scrape(stack, service)
                  if s.name.startswith(("vllm:", "pagedserve:"))
                  and s.name != "vllm:cache_config_info"}  # vLLM's has the cache's labels only
        assert labels == {SERVED}, service
    models = httpx.get(f"{stack.http_url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [SERVED]
    cache_info, = [s for s in scrape(stack, "scheduler") if s.name == "vllm:cache_config_info"]
    assert cache_info.value == 1 and cache_info.labels["num_gpu_blocks"] == str(NUM_GPU_BLOCKS)
    assert cache_info.labels["block_size"] == "16"


def test_the_http_port_serves_the_gateways_metrics(stack, generation):
    generation.Generate(request([5, 6, 7], 2), timeout=60)
    response = httpx.get(f"{stack.http_url}/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    over_http = {s.name for family in text_string_to_metric_families(response.text)
                 for s in family.samples}
    assert over_http == {s.name for s in scrape(stack, "gateway")}
    assert "vllm:e2e_request_latency_seconds_count" in over_http


def test_counters_equal_the_requests_usage_and_gauges_return_to_zero(stack, generation):
    before = {service: scrape(stack, service) for service in ("worker", "scheduler", "gateway")}
    prompts = [[1, 57, 300 % 256, 12, 99], [3, 4, 5, 6, 7, 8, 9, 10, 11]]
    responses = [generation.Generate(request(prompt, 6), timeout=60) for prompt in prompts]
    after = {service: scrape(stack, service) for service in ("worker", "scheduler", "gateway")}

    def delta(service: str, name: str, **labels) -> float:
        return value(after[service], name, **labels) - value(before[service], name, **labels)

    num_prompt_tokens = sum(r.usage.prompt_tokens for r in responses)
    num_generation_tokens = sum(r.usage.completion_tokens for r in responses)
    assert (num_prompt_tokens, num_generation_tokens) == (14, 12)
    assert delta("scheduler", "vllm:prompt_tokens_total") == num_prompt_tokens
    assert delta("scheduler", "vllm:generation_tokens_total") == num_generation_tokens
    assert delta("scheduler", "vllm:request_success_total", finished_reason="length") == 2
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count",
                 "vllm:request_decode_time_seconds_count"):
        assert delta("scheduler", name) == 2
    assert delta("scheduler", "vllm:iteration_tokens_total_count") >= 6
    assert delta("scheduler", "vllm:iteration_tokens_total_sum") >= num_prompt_tokens + 10
    assert delta("scheduler", "pagedserve:scheduler_step_overhead_seconds_count") >= 6
    for name in ("vllm:request_inference_time_seconds_count",
                 "vllm:request_time_per_output_token_seconds_count",
                 "vllm:request_params_n_count", "vllm:request_params_max_tokens_count",
                 "vllm:request_max_num_generation_tokens_count"):
        assert delta("scheduler", name) == 2, name
    assert delta("scheduler", "vllm:request_params_n_sum") == 2
    assert delta("scheduler", "vllm:request_params_max_tokens_sum") == 12
    assert delta("scheduler", "vllm:request_max_num_generation_tokens_sum") == 12
    assert delta("scheduler", "vllm:request_time_per_output_token_seconds_sum") > 0
    assert (delta("scheduler", "vllm:request_inference_time_seconds_sum")
            >= delta("scheduler", "vllm:request_decode_time_seconds_sum"))

    assert delta("gateway", "vllm:request_prompt_tokens_sum") == num_prompt_tokens
    assert delta("gateway", "vllm:request_generation_tokens_sum") == num_generation_tokens
    assert delta("gateway", "vllm:time_to_first_token_seconds_count") == 2
    assert delta("gateway", "vllm:e2e_request_latency_seconds_count") == 2
    assert delta("gateway", "vllm:inter_token_latency_seconds_count") >= 2
    assert delta("gateway", "pagedserve:gateway_requests_total", method="Generate",
                 code="OK") == 2
    assert delta("gateway", "pagedserve:gateway_routing_decisions_total",
                 replica=stack.scheduler_address, reason="short_prompt") == 2
    assert delta("worker", "pagedserve:worker_step_time_seconds_count", phase="forward") >= 6
    assert delta("worker", "pagedserve:worker_step_time_seconds_sum", phase="forward") > 0

    assert_idle(stack)
    idle = scrape(stack, "scheduler")
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:num_requests_swapped", "vllm:kv_cache_usage_perc",
                 "pagedserve:num_requests_paused"):
        assert value(idle, name) == 0, name


def test_preemptions_under_a_small_kv_pool_are_counted(stack, generation):
    preempted_before = stack.load().num_preemptions
    before = scrape(stack, "scheduler")
    prompts = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10] for i in range(4)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(lambda p: generation.Generate(request(p, 70), timeout=120),
                                  prompts))
    assert all(r.usage.completion_tokens == 70 for r in responses)
    num_preemptions = stack.load().num_preemptions - preempted_before
    assert num_preemptions > 0
    after = scrape(stack, "scheduler")
    assert (value(after, "vllm:num_preemptions_total")
            - value(before, "vllm:num_preemptions_total")) == num_preemptions
    # a recomputed prompt is counted once, as in the requests' usage
    assert (value(after, "vllm:prompt_tokens_total")
            - value(before, "vllm:prompt_tokens_total")) == 40
    assert (value(after, "vllm:generation_tokens_total")
            - value(before, "vllm:generation_tokens_total")) == 4 * 70


def test_the_scheduler_logs_its_stats_line_while_it_works(stack, generation, caplog):
    with caplog.at_level(logging.INFO, logger="pagedserve.scheduler_svc.stats"):
        response = generation.Generate(request([5, 6, 7], 40), timeout=60)
        assert response.usage.completion_tokens == 40
        wait_until(lambda: any("Avg generation throughput" in m for m in caplog.messages))
    line = next(m for m in caplog.messages if "Avg generation throughput" in m)
    assert "Running: " in line and "GPU KV cache usage: " in line
    assert "Prefix cache hit rate: " in line


def test_a_cancelled_request_counts_as_aborted(stack, generation):
    before = scrape(stack, "scheduler")
    gateway_before = scrape(stack, "gateway")
    call = generation.GenerateStream(request([1, 2, 3, 4], 150), timeout=60)
    next(call)
    next(call)
    call.cancel()
    aborted = value(before, "vllm:request_success_total", finished_reason="abort")
    wait_until(lambda: value(scrape(stack, "scheduler"), "vllm:request_success_total",
                             finished_reason="abort") == aborted + 1)
    wait_until(lambda: value(scrape(stack, "gateway"), "pagedserve:gateway_requests_total",
                             method="GenerateStream", code="CANCELLED")
               == value(gateway_before, "pagedserve:gateway_requests_total",
                        method="GenerateStream", code="CANCELLED") + 1)
    assert_idle(stack)


def test_swapped_blocks_are_counted_by_the_scheduler_and_the_worker(stack, generation):
    """Groups of two sequences are preempted by swapping (preemption_mode auto)."""
    before = {service: scrape(stack, service) for service in ("scheduler", "worker")}
    prompts = [[9 + i, 8, 7, 6, 5, 4, 3, 2, 1, 11] for i in range(3)]

    def sample_two(prompt):
        req = request(prompt, 40)
        req.sampling.n = 2
        req.sampling.temperature = 0.8
        req.sampling.seed = 5
        return generation.Generate(req, timeout=120)

    with ThreadPoolExecutor(len(prompts)) as pool:
        responses = list(pool.map(sample_two, prompts))
    assert all(r.usage.completion_tokens == 80 for r in responses)
    after = {service: scrape(stack, service) for service in ("scheduler", "worker")}
    for direction in ("out", "in"):
        scheduled = (value(after["scheduler"], "pagedserve:swapped_blocks_total",
                           direction=direction)
                     - value(before["scheduler"], "pagedserve:swapped_blocks_total",
                             direction=direction))
        copied = (value(after["worker"], "pagedserve:worker_swapped_blocks_total",
                        direction=direction)
                  - value(before["worker"], "pagedserve:worker_swapped_blocks_total",
                          direction=direction))
        assert scheduled == copied > 0, direction


@pytest.mark.parametrize("door", ["grpc", "http"])
def test_ttft_counts_from_the_requests_arrival(stack, generation, monkeypatch, door):
    """As vLLM does: the prompt's tokenization (made slow here) is part of the time to first
    token and of the request's latency, at both doors."""
    slow_s = 1.0
    encode = Tokenizer.encode

    def slow_encode(self, text, add_special_tokens=True):
        time.sleep(slow_s)
        return encode(self, text, add_special_tokens)

    monkeypatch.setattr(Tokenizer, "encode", slow_encode)
    before = scrape(stack, "gateway")
    if door == "grpc":
        generation.Generate(gateway_pb2.GenerateRequest(
            text="the fox", sampling=common_pb2.SamplingParams(max_tokens=2)), timeout=60)
    else:
        httpx.post(f"{stack.http_url}/v1/completions", timeout=60, json={
            "model": SERVED, "prompt": "the fox",
            "max_tokens": 2}).raise_for_status()
    after = scrape(stack, "gateway")
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert value(after, f"{name}_count") - value(before, f"{name}_count") == 1
        assert value(after, f"{name}_sum") - value(before, f"{name}_sum") >= slow_s


def test_the_gateway_records_gen_ai_server_metrics_by_operation(stack, generation):
    before = scrape(stack, "gateway")
    generation.Generate(request([5, 6, 7, 8], 4), timeout=60)
    httpx.post(f"{stack.http_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
        "ignore_eos": True}).raise_for_status()
    httpx.post(f"{stack.http_url}/v1/embeddings", timeout=60,
               json={"input": [[5, 6], [7, 8]]}).raise_for_status()
    after = scrape(stack, "gateway")

    def delta(name: str, operation: str) -> float:
        labels = {"gen_ai_operation_name": operation, "gen_ai_provider_name": "pagedserve",
                  "gen_ai_request_model": SERVED}
        return value(after, name, **labels) - value(before, name, **labels)

    for operation, num_requests in (("text_completion", 1), ("chat", 1), ("embeddings", 2)):
        assert delta("gen_ai_server_request_duration_seconds_count", operation) == num_requests
    for operation in ("text_completion", "chat"):
        assert delta("gen_ai_server_time_to_first_token_seconds_count", operation) == 1
        assert delta("gen_ai_server_time_per_output_token_seconds_count", operation) == 1
    assert delta("gen_ai_server_time_to_first_token_seconds_count", "embeddings") == 0
