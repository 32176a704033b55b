"""``pdserve status --router URL``: each engine's circuit-breaker state, read from a router's
real /metrics page (served over HTTP here)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from prometheus_client import generate_latest

from services.cli.status import render_table, router_circuits
from services.control_plane.wire import EngineRole
from tests.unit.router.fakes import FakeFactory, prepared


@pytest.fixture
def metrics_url() -> Iterator[str]:
    rt = prepared(FakeFactory(), ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))
    tripped = rt.pool.get("p1")
    assert tripped is not None
    rt.pool.call_failed(tripped)
    page = generate_latest(rt.metrics.registry)

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if self.path == "/metrics" else 404
            self.send_response(status)
            self.end_headers()
            if status == 200:
                self.wfile.write(page)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def test_the_router_view_names_the_open_circuit(metrics_url: str) -> None:
    circuits = router_circuits(metrics_url)
    assert circuits == {
        "p1": {"state": "open", "trips": 1},
        "d1": {"state": "closed", "trips": 0},
    }
    table = render_table(
        [
            {"engine_id": "p1", "state": "ready", "problems": [], "circuit": circuits["p1"]},
        ],
        "default",
    )
    assert "router circuit open, opened 1 time(s)" in table
