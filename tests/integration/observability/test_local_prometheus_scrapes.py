"""A real Prometheus started on a free port scrapes the targets written from an endpoints.json,
evaluates the rules file, and is gone once stopped."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter, start_http_server

from services.control_plane.local_redis import free_port
from services.devtools.panels import PrometheusAPI
from services.observability.local_prometheus import RULES_FILE, LocalPrometheus

pytestmark = pytest.mark.integration


def test_local_prometheus_scrapes_endpoints_and_stops(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    fallbacks = Counter("pdserve_router_fallbacks_total", "test", ["reason"], registry=registry)
    fallbacks.labels(reason="prefill_failed")
    port = free_port()
    server, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
    prometheus = LocalPrometheus(tmp_path, scrape_interval_s=0.5, rule_files=[RULES_FILE])
    try:
        prometheus.write_targets(
            {"namespace": "ns1", "metrics": {"router": f"http://127.0.0.1:{port}/metrics"}}
        )
        prometheus.start()
        api = PrometheusAPI(prometheus.url)
        try:
            query = 'pdserve_router_fallbacks_total{namespace="ns1",pdserve_process="router"}'
            deadline = time.monotonic() + 60
            while not api.query(query):
                assert time.monotonic() < deadline, f"never scraped:\n{prometheus.log_tail()}"
                time.sleep(0.2)
            fallbacks.labels(reason="prefill_failed").inc()
            while "PdserveRouterFallbacks" not in {
                a["labels"]["alertname"] for a in api.alerts() if a["state"] == "firing"
            }:
                assert time.monotonic() < deadline, f"no alert:\n{prometheus.log_tail()}"
                time.sleep(0.2)
        finally:
            api.close()
    finally:
        prometheus.stop()
        server.shutdown()
        server.server_close()
        thread.join()
    assert not prometheus.running
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{prometheus.url}/-/ready", timeout=5)
