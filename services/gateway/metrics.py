"""The gateway's Prometheus metrics: vLLM's request-level histograms (time to first token,
inter-token latency, end-to-end latency, prompt and generation lengths), seen from the front door,
plus requests by method and status code and the requests admission refused."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pagedserve.services.common.errors import Overloaded
from pagedserve.services.common.outputs import Usage
from pagedserve.services.rpc.metrics import (
    INTER_TOKEN_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    tokens_buckets,
)
from pagedserve.services.rpc.status import status_of
from prometheus_client import CollectorRegistry, Counter, Histogram

MODEL = ["model_name"]
GEN_AI = ["gen_ai_operation_name", "gen_ai_provider_name", "gen_ai_request_model"]
PROVIDER = "pagedserve"  # gen_ai.provider.name, as the traces say
# OpenTelemetry's GenAI semantic conventions' advised buckets
GEN_AI_DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                           20.48, 40.96, 81.92)
GEN_AI_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0)
GEN_AI_TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


@dataclass(frozen=True, slots=True)
class _GenAiHistograms:
    """gen_ai.server.* of one operation (chat, text_completion, embeddings)."""

    request_duration: Histogram
    time_to_first_token: Histogram
    time_per_output_token: Histogram


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        def histogram(name: str, documentation: str, buckets) -> Histogram:
            return Histogram(name, documentation, MODEL, registry=registry,
                             buckets=buckets).labels(model_name)

        self._model_name = model_name
        self.time_to_first_token = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            TTFT_BUCKETS)
        self.inter_token_latency = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            INTER_TOKEN_BUCKETS)
        self.e2e_latency = histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS)
        length_buckets = tokens_buckets(max_model_len)
        self.prompt_tokens = histogram("vllm:request_prompt_tokens",
                                       "Number of prefill tokens processed.", length_buckets)
        self.generation_tokens = histogram("vllm:request_generation_tokens",
                                           "Number of generation tokens processed.",
                                           length_buckets)
        self._requests = Counter("pagedserve:gateway_requests", "Generation calls, by method and "
                                 "status code.", [*MODEL, "method", "code"], registry=registry)
        self._rejections = Counter(
            "pagedserve:admission_rejections", "Requests refused by admission control "
            "(RESOURCE_EXHAUSTED).", MODEL, registry=registry).labels(model_name)
        self._routing = Counter(
            "pagedserve:gateway_routing_decisions", "Submissions to a scheduler replica, by "
            "replica and reason (affinity, held_blocks, overloaded, short_prompt, least_loaded, "
            "round_robin; a failover's resubmission counts again).", [*MODEL, "replica", "reason"],
            registry=registry)
        self._structured = Counter(
            "pagedserve:structured_output_requests", "Requests whose output follows a "
            "constraint, by kind (json_schema, json_object, regex, choice, grammar).",
            [*MODEL, "kind"], registry=registry)
        self._failovers = Counter(
            "pagedserve:gateway_failovers", "Requests moved off a scheduler replica whose stream "
            "broke, by that replica.", [*MODEL, "replica"], registry=registry)
        self._gen_ai_families = (
            Histogram("gen_ai_server_request_duration_seconds", "GenAI server request duration "
                      "(gen_ai.server.request.duration).", GEN_AI, registry=registry,
                      buckets=GEN_AI_DURATION_BUCKETS),
            Histogram("gen_ai_server_time_to_first_token_seconds", "Time to generate the first "
                      "token (gen_ai.server.time_to_first_token).", GEN_AI, registry=registry,
                      buckets=GEN_AI_TTFT_BUCKETS),
            Histogram("gen_ai_server_time_per_output_token_seconds", "Time per output token "
                      "after the first (gen_ai.server.time_per_output_token).", GEN_AI,
                      registry=registry, buckets=GEN_AI_TPOT_BUCKETS))
        self._gen_ai: dict[str, _GenAiHistograms] = {}

    def on_routed(self, replica: str, reason: str) -> None:
        self._routing.labels(self._model_name, replica, reason).inc()

    def on_failover(self, replica: str) -> None:
        self._failovers.labels(self._model_name, replica).inc()

    def start_request(self, arrival_s: float | None = None,
                      operation: str = "text_completion") -> RequestTimer:
        """`arrival_s`: time.monotonic() when the request reached the gateway, before its
        validation and tokenization: vLLM measures TTFT and e2e latency from arrival.
        `operation`: its gen_ai.operation.name."""
        return RequestTimer(self, time.monotonic() if arrival_s is None else arrival_s,
                            self._gen_ai_of(operation))

    def _gen_ai_of(self, operation: str) -> _GenAiHistograms:
        histograms = self._gen_ai.get(operation)
        if histograms is None:
            histograms = _GenAiHistograms(*(family.labels(operation, PROVIDER, self._model_name)
                                            for family in self._gen_ai_families))
            self._gen_ai[operation] = histograms
        return histograms

    @contextlib.contextmanager
    def track(self, method: str) -> Iterator[None]:
        """Count one call by the status code it ends with."""
        try:
            yield
        except (asyncio.CancelledError, GeneratorExit):
            self._requests.labels(self._model_name, method, "CANCELLED").inc()
            raise
        except Exception as exc:
            self._requests.labels(self._model_name, method, status_of(exc)[0].name).inc()
            if isinstance(exc, Overloaded):
                self._rejections.inc()
            raise
        self._requests.labels(self._model_name, method, "OK").inc()

    def record_structured_output(self, kind: str) -> None:
        self._structured.labels(self._model_name, kind).inc()


class RequestTimer:
    """One request's latencies: a scheduler event that brings tokens is one inter-token gap."""

    __slots__ = ("_metrics", "_gen_ai", "_start", "_first", "_last")

    def __init__(self, metrics: GatewayMetrics, arrival_s: float,
                 gen_ai: _GenAiHistograms) -> None:
        self._metrics = metrics
        self._gen_ai = gen_ai
        self._start = arrival_s
        self._first: float | None = None
        self._last: float | None = None

    def on_tokens(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._first = now
            self._metrics.time_to_first_token.observe(now - self._start)
            self._gen_ai.time_to_first_token.observe(now - self._start)
        else:
            self._metrics.inter_token_latency.observe(now - self._last)
        self._last = now

    def finished(self, usage: Usage | None) -> None:
        now = time.monotonic()
        self._metrics.e2e_latency.observe(now - self._start)
        self._gen_ai.request_duration.observe(now - self._start)
        if usage is not None:
            self._metrics.prompt_tokens.observe(usage.prompt_tokens)
            self._metrics.generation_tokens.observe(usage.completion_tokens)
            if usage.completion_tokens > 1 and self._first is not None:
                self._gen_ai.time_per_output_token.observe(
                    (self._last - self._first) / (usage.completion_tokens - 1))
