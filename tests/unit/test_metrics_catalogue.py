"""Every metric the router and the engine services export is in docs/metrics.md, with the
series it really exports (the dashboards are checked against the same catalogue in
tests/deploy)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.devtools.dashboards import catalogue_series, exported_series
from services.kv_events.publisher import PublisherMetrics
from services.planner.metrics import PlannerMetrics
from services.router.metrics import RouterMetrics
from services.serving.host.metrics import EngineServiceMetrics

CATALOGUE = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def _router() -> CollectorRegistry:
    return RouterMetrics(CollectorRegistry()).registry


def _engine_service() -> CollectorRegistry:
    registry = CollectorRegistry()
    EngineServiceMetrics(registry, "decode-0", "decode")
    return registry


def _planner() -> CollectorRegistry:
    return PlannerMetrics(CollectorRegistry()).registry


def _kv_event_publisher() -> CollectorRegistry:
    metrics = PublisherMetrics(CollectorRegistry())
    for event in ("BlockStored", "BlockRemoved", "AllBlocksCleared"):
        metrics.events.labels(type=event)
    for outcome in ("served", "malformed"):
        metrics.replays.labels(outcome=outcome)
    return metrics.registry


@pytest.mark.parametrize(
    ("registry_of", "prefix", "section", "recent"),
    [
        (_router, "pdserve_router_", "Router", "pdserve_router_engine_timeouts_total"),
        (
            _engine_service,
            "pdserve_engine_",
            "Engine services",
            "pdserve_engine_producer_check_fallbacks_total",
        ),
        (_planner, "pdserve_planner_", "Planner", "pdserve_planner_decisions_total"),
        (
            _kv_event_publisher,
            "pdserve_kv_events_publisher_",
            "KV-event publisher",
            "pdserve_kv_events_publisher_replays_total",
        ),
    ],
    ids=["router", "engine-service", "planner", "kv-event-publisher"],
)
def test_every_exported_metric_is_in_the_catalogue(
    registry_of: Callable[[], CollectorRegistry], prefix: str, section: str, recent: str
) -> None:
    exported = {
        series
        for series in exported_series(generate_latest(registry_of()).decode())
        if not series.endswith("_created")  # prometheus_client's creation timestamps
    }
    documented = {
        series
        for name, series_set in catalogue_series(CATALOGUE.read_text()).items()
        if name.startswith(prefix)
        for series in series_set
    }
    assert recent in exported  # the exporter really is the one under test
    assert exported - documented == set(), f"add them to docs/metrics.md ({section})"
