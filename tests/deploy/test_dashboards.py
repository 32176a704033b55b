"""The Grafana dashboards: every query parses as PromQL (a real parser, ``promql-parser``), names
only series of docs/metrics.md, and together they chart the views the issue asks for.

The stronger check, every series exported by a running stack, is test_dashboards_live.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from services.devtools.dashboards import (
    DashboardQuery,
    PromQLError,
    catalogue_series,
    dashboard_queries,
    exported_series,
    series_in_query,
    substitute_variables,
)
from tests.deploy.chart import DASHBOARDS, REPO

CATALOGUE = catalogue_series((REPO / "docs" / "metrics.md").read_text())


def load(path: Path) -> dict[str, Any]:
    dashboard = json.loads(path.read_text())
    assert isinstance(dashboard, dict)
    return dashboard


QUERIES: list[DashboardQuery] = [q for path in DASHBOARDS for q in dashboard_queries(load(path))]


def all_series() -> set[str]:
    return {name for q in QUERIES for name in series_in_query(q.expr)}


def test_the_catalogue_is_read() -> None:
    assert CATALOGUE["pdserve_kv_transfer_latency_seconds"] == {
        "pdserve_kv_transfer_latency_seconds_bucket",
        "pdserve_kv_transfer_latency_seconds_sum",
        "pdserve_kv_transfer_latency_seconds_count",
    }
    assert CATALOGUE["pdserve_engine_queue_depth"] == {"pdserve_engine_queue_depth"}
    assert len(CATALOGUE) >= 40


@pytest.mark.parametrize("query", QUERIES, ids=lambda q: f"{q.dashboard}: {q.location}")
def test_every_query_parses_as_promql(query: DashboardQuery) -> None:
    assert series_in_query(query.expr), f"{query.location} names no series"


def test_every_series_is_in_the_metric_catalogue() -> None:
    documented = set().union(*CATALOGUE.values())
    unknown = {
        f"{name} ({q.dashboard}: {q.location})"
        for q in QUERIES
        for name in series_in_query(q.expr)
        if name not in documented
    }
    assert unknown == set(), "add them to docs/metrics.md or fix the dashboard"


def test_the_dashboards_chart_every_view_of_the_issue() -> None:
    charted = all_series()
    required = {
        # KV-transfer latency, GB/s, bytes and descriptors per transfer
        "pdserve_kv_transfer_latency_seconds_bucket",
        "pdserve_kv_transfer_bytes_total",
        "pdserve_kv_transfer_descriptors_sum",
        # failed and expired transfers, recomputes, fallbacks
        "pdserve_kv_transfer_failures_total",
        "pdserve_kv_transfer_expired_leases_total",
        "pdserve_kv_transfer_recomputes_total",
        "pdserve_router_fallbacks_total",
        "pdserve_router_prefill_retries_total",
        # TTFT split, ITL, router overhead
        "pdserve_router_ttft_phase_seconds_sum",
        "pdserve_router_itl_seconds_bucket",
        "pdserve_router_overhead_seconds_bucket",
        # handshake readiness per (pp, tp), queue depth and KV usage per engine
        "pdserve_engine_handshake_ranks_published",
        "pdserve_engine_queue_depth",
        "pdserve_engine_kv_blocks_free",
        "pdserve_engine_kv_blocks_total",
    }
    assert required - charted == set()


def test_latency_percentiles_are_split_by_engine_pair_and_by_rank_pair() -> None:
    latency = [q.expr for q in QUERIES if "pdserve_kv_transfer_latency_seconds_bucket" in q.expr]
    by_engines = "sum by (le, producer_engine, consumer_engine) ("
    by_ranks = "sum by (le, producer_engine, consumer_engine, producer_rank, consumer_rank) ("
    for quantile in ("0.5", "0.95", "0.99"):
        assert any(e.startswith(f"histogram_quantile({quantile}, {by_engines}") for e in latency)
    assert any(e.startswith(f"histogram_quantile(0.99, {by_ranks}") for e in latency)


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_structure(path: Path) -> None:
    dashboard = load(path)
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["namespace"]["type"] == "query"
    panels = dashboard["panels"]
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids))
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["description"], panel["title"]
        for target in panel["targets"]:
            assert 'namespace=~"$namespace"' in target["expr"], panel["title"]
    uids = {load(p)["uid"] for p in DASHBOARDS}
    assert len(uids) == len(DASHBOARDS)


def test_variables_are_substituted_for_parsing() -> None:
    text = substitute_variables('rate(x{a=~"$engine", b=~"${decode_engine}"}[$__rate_interval])')
    assert text == 'rate(x{a=~".*", b=~".*"}[5m])'


@pytest.mark.parametrize(
    "broken",
    [
        "histogram_quantile(0.9, sum by (le) (rate(x_bucket[5m]))",  # unbalanced
        "rate(x_total)",  # rate needs a range
        'sum by (le) ({job="router"})',  # no metric name: uncheckable
    ],
)
def test_the_parser_rejects_broken_queries(broken: str) -> None:
    with pytest.raises(PromQLError):
        series_in_query(broken)


def test_exported_series_include_declared_families_without_samples() -> None:
    registry = CollectorRegistry()
    Counter("pdserve_x_failures", "h", ["reason"], registry=registry)  # no child yet
    Histogram("pdserve_x_seconds", "h", registry=registry).observe(0.1)
    Gauge("pdserve_x_depth", "h", registry=registry).set(3)
    series = exported_series(generate_latest(registry).decode())
    assert {
        "pdserve_x_failures_total",
        "pdserve_x_seconds_bucket",
        "pdserve_x_seconds_sum",
        "pdserve_x_seconds_count",
        "pdserve_x_depth",
    } <= series
