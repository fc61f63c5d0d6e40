"""Prometheus metrics of a service, in its own registry (the services may share a process, as in
tests). Names and buckets are vLLM's where vLLM has the metric, so its dashboards read pagedserve
unchanged; `pagedserve:...` otherwise. prometheus_client appends `_total` to counters itself.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

logger = logging.getLogger(__name__)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
INTER_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                       5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# pagedserve's own: an engine step's parts, 100 us to 10 s
STEP_TIME_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def tokens_buckets(max_model_len: int) -> list[int]:
    """vLLM's request-length buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10 ** exponent
            if value > max_model_len:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass(slots=True)
class MetricsServer:
    port: int
    _httpd: Any

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(registry: CollectorRegistry, host: str, port: int,
                         service: str) -> MetricsServer | None:
    """None when `port` is -1 (off)."""
    if port < 0:
        return None
    httpd, _ = start_http_server(port, addr=host, registry=registry)
    server = MetricsServer(httpd.server_port, httpd)
    logger.info("%s metrics on http://%s:%d/metrics", service, host, server.port)
    return server
