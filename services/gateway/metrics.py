"""The gateway's Prometheus metrics: vLLM's request-level histograms (time to first token,
inter-token latency, end-to-end latency, prompt and generation lengths), seen from the front door,
plus requests by method and status code and the requests admission refused."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator

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
            "replica and reason (affinity, overloaded, short_prompt, least_loaded, round_robin; "
            "a failover's resubmission counts again).", [*MODEL, "replica", "reason"],
            registry=registry)
        self._failovers = Counter(
            "pagedserve:gateway_failovers", "Requests moved off a scheduler replica whose stream "
            "broke, by that replica.", [*MODEL, "replica"], registry=registry)

    def on_routed(self, replica: str, reason: str) -> None:
        self._routing.labels(self._model_name, replica, reason).inc()

    def on_failover(self, replica: str) -> None:
        self._failovers.labels(self._model_name, replica).inc()

    def start_request(self, arrival_s: float | None = None) -> RequestTimer:
        """`arrival_s`: time.monotonic() when the request reached the gateway, before its
        validation and tokenization: vLLM measures TTFT and e2e latency from arrival."""
        return RequestTimer(self, time.monotonic() if arrival_s is None else arrival_s)

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


class RequestTimer:
    """One request's latencies: a scheduler event that brings tokens is one inter-token gap."""

    __slots__ = ("_metrics", "_start", "_last")

    def __init__(self, metrics: GatewayMetrics, arrival_s: float) -> None:
        self._metrics = metrics
        self._start = arrival_s
        self._last: float | None = None

    def on_tokens(self) -> None:
        now = time.monotonic()
        if self._last is None:
            self._metrics.time_to_first_token.observe(now - self._start)
        else:
            self._metrics.inter_token_latency.observe(now - self._last)
        self._last = now

    def finished(self, usage: Usage | None) -> None:
        self._metrics.e2e_latency.observe(time.monotonic() - self._start)
        if usage is not None:
            self._metrics.prompt_tokens.observe(usage.prompt_tokens)
            self._metrics.generation_tokens.observe(usage.completion_tokens)
