"""The planner's loop without a router: it announces its metrics, holds every interval whose
figures cannot be read (counted as ``no_metrics``), stops when asked, and refuses at start what
it cannot run with."""

from __future__ import annotations

import contextlib
import http.server
import io
import json
import socket
import threading
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry

from services.planner.config import PlannerSettings
from services.planner.errors import PlannerConfigError
from services.planner.main import run
from services.planner.metrics import PlannerMetrics
from services.serving.ready import parse_ready_line


def _unreachable_url() -> str:
    with socket.socket() as probe:  # a port nobody listens on once closed
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


class _StopAfter(io.StringIO):
    """Output that sets ``stop`` once ``lines`` lines were written."""

    def __init__(self, stop: threading.Event, lines: int) -> None:
        super().__init__()
        self._stop, self._lines = stop, lines

    def write(self, text: str) -> int:
        written = super().write(text)
        if self.getvalue().count("\n") >= self._lines:
            self._stop.set()
        return written


def test_without_a_router_every_interval_holds_and_is_counted() -> None:
    settings = PlannerSettings(
        router_url=_unreachable_url(),
        interval_s=0.01,
        metrics_port=0,
        scrape_timeout_s=2,
        decode_min=2,
        decode_max=3,
    )
    stop = threading.Event()
    out = _StopAfter(stop, lines=3)
    metrics = PlannerMetrics(CollectorRegistry())
    assert run(settings, stop=stop, out=out, metrics=metrics) == 0
    ready, *records = out.getvalue().splitlines()
    assert parse_ready_line(ready) is not None
    assert [json.loads(r)["decode"] for r in records] == [
        {"correction": 1.0, "desired": 2, "needed": 2, "reason": "no_metrics"}
    ] * 2
    registry = metrics.registry
    labels = {"pool": "prefill", "reason": "no_metrics"}
    assert registry.get_sample_value("pdserve_planner_decisions_total", labels) == 2
    assert registry.get_sample_value("pdserve_planner_desired_replicas", {"pool": "decode"}) == 2


def test_a_taken_metrics_port_and_an_unknown_profile_are_refused_at_start() -> None:
    stop = threading.Event()
    stop.set()
    with pytest.raises(PlannerConfigError, match="unknown sim profile"):
        run(PlannerSettings(profile="nope", metrics_port=0), stop=stop, out=io.StringIO())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(PlannerConfigError, match="cannot serve metrics"):
            run(PlannerSettings(metrics_port=port), stop=stop, out=io.StringIO())


def test_a_router_url_that_is_not_http_is_refused() -> None:
    with pytest.raises(ValueError, match="router_url"):
        PlannerSettings(router_url="redis://localhost:6379")


@contextlib.contextmanager
def _router_serving(model: str) -> Iterator[str]:
    """A real HTTP server answering ``/v1/models`` with ``model`` and an empty router
    ``/metrics``, in a thread; its URL."""
    models = json.dumps({"object": "list", "data": [{"id": model, "object": "model"}]})
    metrics = "# TYPE pdserve_router_requests_total counter\n"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = (models if self.path == "/v1/models" else metrics).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_profile_of_another_model_or_layout_is_refused_at_start_naming_both() -> None:
    stop = threading.Event()
    stop.set()
    with _router_serving("tiny") as url:
        settings = PlannerSettings(router_url=url, metrics_port=0)
        with pytest.raises(PlannerConfigError, match=r"Llama-3.1-8B-Instruct.*serves tiny"):
            run(settings, stop=stop, out=io.StringIO())
    with _router_serving("sim-llama-3.1-8b-h100") as url:
        out = io.StringIO()
        assert run(PlannerSettings(router_url=url, metrics_port=0), stop=stop, out=out) == 0
        assert parse_ready_line(out.getvalue().splitlines()[0]) is not None
        with pytest.raises(PlannerConfigError, match=r"TP=1.*decode engines here: PP=1 x TP=2"):
            run(
                PlannerSettings(router_url=url, metrics_port=0, decode_layout="1x2"),
                stop=stop,
                out=io.StringIO(),
            )
