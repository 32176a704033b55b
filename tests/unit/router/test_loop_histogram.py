"""``LoopHistogram`` (the per-token ITL histogram) exposes what ``prometheus_client.Histogram``
would for the same observations."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.router.metrics import LoopHistogram, RouterMetrics

BUCKETS = (0.0005, 0.001, 0.0025, 0.01, 1, 2.5, 60)


def test_exposition_equals_prometheus_clients_histogram() -> None:
    reference_registry, loop_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "doc", buckets=BUCKETS, registry=reference_registry)
    loop = LoopHistogram("x_seconds", "doc", BUCKETS)
    loop_registry.register(loop)
    # Bounds themselves (le is inclusive), between, zero, and above the last bound (+Inf).
    for value in (0.0, 0.0004, 0.0005, 0.0007, 0.001, 1.0, 2.5, 59.9, 61.0, 1e6):
        reference.observe(value)
        loop.observe(value)
    expected = [
        line
        for line in generate_latest(reference_registry).decode().splitlines()
        if "_created" not in line
    ]
    assert generate_latest(loop_registry).decode().splitlines() == expected


def test_the_router_itl_metric_counts_each_observation() -> None:
    metrics = RouterMetrics()
    for gap in (0.002, 0.02, 0.2):
        metrics.itl.observe(gap)
    registry = metrics.registry
    assert registry.get_sample_value("pdserve_router_itl_seconds_count") == 3
    assert registry.get_sample_value("pdserve_router_itl_seconds_bucket", {"le": "0.025"}) == 2
    assert abs((registry.get_sample_value("pdserve_router_itl_seconds_sum") or 0) - 0.222) < 1e-9
