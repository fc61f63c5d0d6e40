"""A /metrics port holds a bounded number of connections (a thread each): idle ones are closed
after metrics_timeout_s, ones past metrics_max_connections at once, and scrapes still work."""

import socket
import threading
import urllib.request

from pagedserve.services.common.config import MetricsConfig
from pagedserve.services.rpc.metrics import start_metrics_server
from prometheus_client import CollectorRegistry, Counter


def test_idle_connections_are_capped_and_closed_while_scrapes_are_served():
    registry = CollectorRegistry()
    Counter("scrapes_seen", "a metric to scrape", registry=registry).inc()
    server = start_metrics_server(registry, "127.0.0.1", MetricsConfig(
        metrics_port=0, metrics_max_connections=4, metrics_timeout_s=0.5), "test")
    idle = []
    try:
        threads_before = threading.active_count()
        idle = [socket.create_connection(("127.0.0.1", server.port), timeout=5)
                for _ in range(50)]
        # 4 hold a thread each until their timeout, the other 46 are closed unanswered
        closed = [sock.recv(1) for sock in idle]
        assert closed == [b""] * 50
        assert threading.active_count() <= threads_before + 4
        url = f"http://127.0.0.1:{server.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as response:
            assert "scrapes_seen_total 1.0" in response.read().decode()
    finally:
        for sock in idle:
            sock.close()
        server.stop()
