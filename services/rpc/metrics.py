"""Prometheus metrics of a service, in its own registry (the services may share a process, as in
tests). Names and buckets are vLLM's where vLLM has the metric, so its dashboards read pagedserve
unchanged; `pagedserve:...` otherwise. prometheus_client appends `_total` to counters itself.
"""

from __future__ import annotations

import logging
import socket
import threading
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from pagedserve.services.common.config import MetricsConfig
from prometheus_client import CollectorRegistry, make_wsgi_app

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


class _MetricsHandler(WSGIRequestHandler):
    def setup(self) -> None:
        self.timeout = self.server.timeout_s  # type: ignore[attr-defined]
        super().setup()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most `max_connections` of them: one more is closed at once,
    and a connection silent for `timeout_s` ends its thread."""

    daemon_threads = True
    request_queue_size = 128  # socketserver's 5 makes a burst of connects wait on SYN retries

    def configure(self, max_connections: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        logger.debug("/metrics connection from %s failed", client_address, exc_info=True)


@dataclass(slots=True)
class MetricsServer:
    port: int
    _httpd: _BoundedServer

    def stop(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()


def start_metrics_server(registry: CollectorRegistry, host: str, config: MetricsConfig,
                         service: str) -> MetricsServer | None:
    """None when `config.metrics_port` is -1 (off)."""
    if config.metrics_port < 0:
        return None
    server_class = type("MetricsHttpServer", (_BoundedServer,), {
        "address_family": socket.AF_INET6 if ":" in host else socket.AF_INET})
    httpd = make_server(host, config.metrics_port, make_wsgi_app(registry), server_class,
                        handler_class=_MetricsHandler)
    httpd.configure(config.metrics_max_connections, config.metrics_timeout_s)
    threading.Thread(target=httpd.serve_forever, name=f"{service}-metrics", daemon=True).start()
    server = MetricsServer(httpd.server_port, httpd)
    logger.info("%s metrics on http://%s:%d/metrics", service, host, server.port)
    return server
