"""The planner's loop without a router: it announces its metrics, holds every interval whose
figures cannot be read (counted as ``no_metrics``), stops when asked, and refuses at start what
it cannot run with."""

from __future__ import annotations

import io
import json
import socket
import threading

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
