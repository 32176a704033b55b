"""``LoopHistogram`` (the request path's histograms: ITL, TTFT and its phases, end-to-end,
queue time, overhead) exposes what ``prometheus_client.Histogram`` would for the same
observations."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from services.router.metrics import RouterMetrics
from services.router.metrics.kinds import LoopHistogram

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


def test_labelled_exposition_equals_prometheus_clients_histogram() -> None:
    reference_registry, loop_registry = CollectorRegistry(), CollectorRegistry()
    reference = Histogram(
        "y_seconds", "doc", ["path"], buckets=BUCKETS, registry=reference_registry
    )
    loop = LoopHistogram("y_seconds", "doc", BUCKETS, ["path"])
    loop_registry.register(loop)
    for path, value in (("pd", 0.0004), ("local", 2.0), ("pd", 0.001), ("pd", 70.0)):
        reference.labels(path).observe(value)
        loop.labels(path).observe(value)
    expected = [
        line
        for line in generate_latest(reference_registry).decode().splitlines()
        if "_created" not in line
    ]
    assert generate_latest(loop_registry).decode().splitlines() == expected
    assert loop.labels("pd") is loop.labels("pd")  # each label set's series is made once


def test_label_mistakes_are_errors() -> None:
    labelled = LoopHistogram("z_seconds", "doc", BUCKETS, ["path"])
    with pytest.raises(ValueError, match="labels"):
        labelled.observe(1.0)
    with pytest.raises(ValueError, match="takes labels"):
        labelled.labels("a", "b")


def test_the_router_latency_metrics_count_each_observation() -> None:
    metrics = RouterMetrics()
    metrics.ttft_by("disaggregated").observe(0.02)
    metrics.e2e_by("completions").observe(0.3)
    metrics.queue_time.observe(0.0001)
    registry = metrics.registry
    assert (
        registry.get_sample_value(
            "pdserve_router_ttft_seconds_bucket", {"path": "disaggregated", "le": "0.025"}
        )
        == 1
    )
    assert (
        registry.get_sample_value(
            "pdserve_router_e2e_latency_seconds_count", {"endpoint": "completions"}
        )
        == 1
    )
    assert registry.get_sample_value("pdserve_router_queue_time_seconds_count") == 1


def test_the_router_itl_metric_counts_each_observation() -> None:
    metrics = RouterMetrics()
    for gap in (0.002, 0.02, 0.2):
        metrics.itl.observe(gap)
    registry = metrics.registry
    assert registry.get_sample_value("pdserve_router_itl_seconds_count") == 3
    assert registry.get_sample_value("pdserve_router_itl_seconds_bucket", {"le": "0.025"}) == 2
    assert abs((registry.get_sample_value("pdserve_router_itl_seconds_sum") or 0) - 0.222) < 1e-9
