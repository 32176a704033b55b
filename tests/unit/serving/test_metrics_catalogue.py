"""Every metric the engine service exports is in docs/metrics.md, with the series it exports."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from services.devtools.dashboards import catalogue_series, exported_series
from services.serving.metrics import EngineServiceMetrics

CATALOGUE = Path(__file__).resolve().parents[3] / "docs" / "metrics.md"


def test_every_engine_service_metric_is_in_the_catalogue() -> None:
    metrics = EngineServiceMetrics(CollectorRegistry(), "decode-0", "decode")
    exported = {
        series
        for series in exported_series(generate_latest(metrics.registry).decode())
        if not series.endswith("_created")  # prometheus_client's creation timestamps
    }
    documented = {
        series
        for name, series_set in catalogue_series(CATALOGUE.read_text()).items()
        if name.startswith("pdserve_engine_")
        for series in series_set
    }
    assert "pdserve_engine_producer_check_fallbacks_total" in exported
    assert exported - documented == set(), "add them to docs/metrics.md (Engine services)"
