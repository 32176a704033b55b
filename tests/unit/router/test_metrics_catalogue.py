"""Every metric the router exports is in docs/metrics.md, with the series it really exports."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from services.devtools.dashboards import catalogue_series, exported_series
from services.router.metrics import RouterMetrics

CATALOGUE = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def test_every_router_metric_is_in_the_catalogue() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    exported = {
        series
        for series in exported_series(generate_latest(metrics.registry).decode())
        if not series.endswith("_created")  # prometheus_client's creation timestamps
    }
    documented = {
        series
        for name, series_set in catalogue_series(CATALOGUE.read_text()).items()
        if name.startswith("pdserve_router_")
        for series in series_set
    }
    assert "pdserve_router_engine_timeouts_total" in exported
    assert exported - documented == set(), "add them to docs/metrics.md (Router)"
