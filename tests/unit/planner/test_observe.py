"""The router's figures as the planner reads them: from a real ``RouterMetrics`` registry's
exposition text, recorded through its own methods, into snapshots and interval deltas."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.planner.errors import MetricsUnreadable
from services.planner.observe import interval_between, parse_router_metrics
from services.router.metrics import RouterMetrics


def _text(metrics: RouterMetrics) -> str:
    return generate_latest(metrics.registry).decode()


def _serve(metrics: RouterMetrics, requests: int, ttft_s: float, itl_s: float) -> None:
    """``requests`` answered, each with its TTFT and three token gaps."""
    for index in range(requests):
        endpoint = "completions" if index % 2 else "chat_completions"
        metrics.requests_by(endpoint, "ok").inc()
        metrics.ttft_by("disaggregated" if index % 3 else "local").observe(ttft_s)
        for _ in range(3):
            metrics.itl.observe(itl_s)
        metrics.e2e_by(endpoint).observe(ttft_s + 3 * itl_s)


def test_a_fresh_router_reads_as_zeros_with_its_ready_engines() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    metrics.ready_engines.labels(role="prefill").set(2)
    metrics.ready_engines.labels(role="decode").set(3)
    snapshot = parse_router_metrics(_text(metrics), at_s=1.0)
    assert (snapshot.requests, snapshot.ttft_count, snapshot.itl_count) == (0, 0, 0)
    assert (snapshot.ready_prefill, snapshot.ready_decode) == (2, 3)


def test_an_interval_gives_the_rate_and_mean_latencies_of_what_happened_in_it() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    _serve(metrics, 4, ttft_s=1.0, itl_s=1.0)  # before the interval: not counted in it
    metrics.requests_by("completions", "rate_limited").inc()
    before = parse_router_metrics(_text(metrics), at_s=10.0)
    _serve(metrics, 6, ttft_s=0.2, itl_s=0.02)
    metrics.requests_by("completions", "no_engine").inc(2)  # errors are arrivals too
    after = parse_router_metrics(_text(metrics), at_s=14.0)
    interval = interval_between(before, after)
    assert interval is not None
    assert interval.duration_s == 4.0
    assert interval.rate_rps == pytest.approx(8 / 4)
    assert interval.ttft_ms == pytest.approx(200)
    assert interval.itl_ms == pytest.approx(20)
    assert after.ready_prefill is None  # the router exported none


def test_an_interval_without_tokens_has_no_latencies() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    before = parse_router_metrics(_text(metrics), at_s=0.0)
    after = parse_router_metrics(_text(metrics), at_s=5.0)
    interval = interval_between(before, after)
    assert interval is not None
    assert (interval.rate_rps, interval.ttft_ms, interval.itl_ms) == (0, None, None)


def test_a_restarted_router_gives_no_interval() -> None:
    old = RouterMetrics(CollectorRegistry())
    _serve(old, 5, ttft_s=0.1, itl_s=0.01)
    before = parse_router_metrics(_text(old), at_s=0.0)
    after = parse_router_metrics(_text(RouterMetrics(CollectorRegistry())), at_s=5.0)
    assert interval_between(before, after) is None
    assert interval_between(before, before) is None  # no time passed


@pytest.mark.parametrize(
    "text",
    [
        "# TYPE some_other_total counter\nsome_other_total 3\n",
        "this is { not prometheus",
    ],
    ids=["not-a-router", "not-prometheus"],
)
def test_text_that_is_not_a_routers_metrics_is_refused(text: str) -> None:
    with pytest.raises(MetricsUnreadable):
        parse_router_metrics(text, at_s=0.0)


def test_an_interval_gives_the_mean_lengths_of_the_requests_that_finished_in_it() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    metrics.prompt_tokens.observe(5000)  # before the interval: not in its means
    metrics.generation_tokens.observe(1)
    before = parse_router_metrics(_text(metrics), at_s=0.0)
    for prompt, generated in ((100, 10), (300, 30), (200, 20)):
        metrics.prompt_tokens.observe(prompt)
        metrics.generation_tokens.observe(generated)
    after = parse_router_metrics(_text(metrics), at_s=5.0)
    interval = interval_between(before, after)
    assert interval is not None
    assert (interval.input_tokens, interval.output_tokens) == (200, 20)
    idle = interval_between(after, parse_router_metrics(_text(metrics), at_s=9.0))
    assert idle is not None and (idle.input_tokens, idle.output_tokens) == (None, None)


def test_a_router_without_token_figures_gives_no_lengths() -> None:
    text = (
        "# TYPE pdserve_router_requests_total counter\n"
        'pdserve_router_requests_total{endpoint="completions",outcome="ok"} 3\n'
    )
    before = parse_router_metrics(text, at_s=0.0)
    after = parse_router_metrics(text.replace("} 3", "} 9"), at_s=3.0)
    assert before.prompt_tokens is None
    interval = interval_between(before, after)
    assert interval is not None and interval.rate_rps == 2
    assert (interval.input_tokens, interval.output_tokens) == (None, None)


def _relay(metrics: RouterMetrics, engine: str, role: str, load: tuple[int, int, int, int]) -> None:
    """An engine's load as the router relays it (``EnginePool._export_load``): queue depth,
    running requests, KV blocks free and total."""
    kinds = ("queue_depth", "running_requests", "kv_blocks_free", "kv_blocks_total")
    for kind, value in zip(kinds, load, strict=True):
        metrics.engine_load.labels(engine=engine, role=role, kind=kind).set(value)


def test_engines_loads_are_read_per_engine_and_totalled_per_pool() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    _relay(metrics, "prefill-0", "prefill", (3, 2, 900, 1000))
    _relay(metrics, "prefill-1", "prefill", (5, 2, 1000, 1000))
    _relay(metrics, "decode-0", "decode", (0, 40, 50, 1000))
    _relay(metrics, "decode-1", "decode", (1, 60, 150, 1000))
    _relay(metrics, "both-0", "both", (9, 9, 0, 1000))  # colocated: in neither pool
    snapshot = parse_router_metrics(_text(metrics), at_s=0.0)
    assert snapshot.engine_loads is not None and len(snapshot.engine_loads) == 5
    prefill = snapshot.pool_load("prefill")
    assert prefill is not None
    assert (prefill.engines, prefill.queue_depth, prefill.running_requests) == (2, 8, 4)
    assert prefill.queue_per_engine == 4
    assert prefill.kv_usage == pytest.approx(0.05)
    decode = snapshot.pool_load("decode")
    assert decode is not None
    assert (decode.kv_blocks_free, decode.kv_blocks_total) == (200, 2000)
    assert decode.kv_usage == pytest.approx(0.9)


def test_a_router_without_engine_loads_gives_none() -> None:
    bare = RouterMetrics(CollectorRegistry())  # the family is declared, no engine yet
    snapshot = parse_router_metrics(_text(bare), at_s=0.0)
    assert snapshot.engine_loads == ()
    assert snapshot.pool_load("decode") is None
    older = parse_router_metrics(
        "# TYPE pdserve_router_requests_total counter\n"
        'pdserve_router_requests_total{endpoint="completions",outcome="ok"} 3\n',
        at_s=0.0,
    )
    assert older.engine_loads is None and older.pool_load("prefill") is None


def test_engines_without_kv_capacity_give_no_kv_usage() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    _relay(metrics, "decode-0", "decode", (2, 1, 0, 0))  # the engine reports no KV blocks
    decode = parse_router_metrics(_text(metrics), at_s=0.0).pool_load("decode")
    assert decode is not None and decode.kv_usage is None and decode.queue_depth == 2


def test_an_interval_gives_the_mean_cached_tokens_of_the_prefill_pools_placements() -> None:
    metrics = RouterMetrics(CollectorRegistry())
    metrics.cached_tokens_by("prefill").observe(100)  # before the interval
    before = parse_router_metrics(_text(metrics), at_s=0.0)
    for cached in (800, 400):
        metrics.cached_tokens_by("prefill").observe(cached)
    metrics.cached_tokens_by("decode").observe(5000)  # the decode pool's: not prefill work
    after = parse_router_metrics(_text(metrics), at_s=5.0)
    interval = interval_between(before, after)
    assert interval is not None and interval.cached_tokens == pytest.approx(600)
    # No placement in an interval: no figure (the planner keeps the last).
    again = interval_between(after, parse_router_metrics(_text(metrics), at_s=9.0))
    assert again is not None and again.cached_tokens is None
