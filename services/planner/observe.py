"""The router's figures the planner reads, from its ``/metrics`` text, and an interval's deltas.

Read (names from ``services/router/metrics.py``, by string: the planner does not import the
router): ``pdserve_router_requests_total`` (every endpoint and outcome: the arrivals the pools
serve), ``pdserve_router_ttft_seconds`` (every path) and ``pdserve_router_itl_seconds`` (their
``_sum`` and ``_count``: an interval's mean is the sums' delta over the counts'), and
``pdserve_router_ready_engines{role}`` (the engines each pool has now), and
``pdserve_router_request_prompt_tokens`` and ``pdserve_router_request_generation_tokens`` (per
request histograms: an interval's mean input and output lengths are their sums' deltas over
their counts'). A router without the token histograms (an older one) gives ``None`` lengths:
the planner then takes them from its settings. ``pdserve_router_cached_tokens{pool="prefill"}``
(per request placed on the prefill pool: the prompt tokens its engine holds, as the router's
cache view says, exact with KV events) gives an interval's mean cached prompt tokens the same
way (``None``: the router reports none, and the planner assumes nothing cached).

Also read: ``pdserve_router_engine_load{engine, role, kind}``, the load each engine last reported
through the control plane and the router relays (``kind``: ``queue_depth``,
``running_requests``, ``kv_blocks_free``, ``kv_blocks_total``): gauges of the moment of the
read, not interval deltas, kept per engine (:class:`EngineReport`) so that several routers
relaying the same engine count it once (``fleet.py``), and totalled per pool by
:func:`pool_load`. A router without the family gives ``None`` (the rules that use it change
nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from services.planner.errors import MetricsUnreadable

REQUESTS = "pdserve_router_requests_total"
TTFT = "pdserve_router_ttft_seconds"
ITL = "pdserve_router_itl_seconds"
READY_ENGINES = "pdserve_router_ready_engines"
PROMPT_TOKENS = "pdserve_router_request_prompt_tokens"
GENERATION_TOKENS = "pdserve_router_request_generation_tokens"
CACHED_TOKENS = "pdserve_router_cached_tokens"
_CACHED_PARTS = (f"{CACHED_TOKENS}_sum", f"{CACHED_TOKENS}_count")
ENGINE_LOAD = "pdserve_router_engine_load"
LOAD_KINDS = ("queue_depth", "running_requests", "kv_blocks_free", "kv_blocks_total")
_SUMMED = tuple(
    f"{family}_{part}"
    for family in (TTFT, ITL, PROMPT_TOKENS, GENERATION_TOKENS)
    for part in ("sum", "count")
)


@dataclass(frozen=True)
class EngineReport:
    """One engine's load as a router relays it (a kind the router did not export reads 0, as
    the engine's own default)."""

    engine: str
    role: str
    """``prefill``, ``decode`` or ``both`` (a colocated engine: in neither pool's figures)."""
    queue_depth: float = 0.0
    """Requests waiting in the engine's scheduler (not yet running)."""
    running_requests: float = 0.0
    kv_blocks_free: float = 0.0
    kv_blocks_total: float = 0.0
    """0 when the engine reports no KV capacity."""


@dataclass(frozen=True)
class PoolLoad:
    """The load of one pool's engines at the read, totalled over them."""

    engines: int
    """Engines that reported (at least 1)."""
    queue_depth: float
    running_requests: float
    kv_blocks_free: float
    kv_blocks_total: float

    @property
    def kv_usage(self) -> float | None:
        """``1 - free / total`` over the pool's KV blocks; ``None`` when none reports any."""
        if self.kv_blocks_total <= 0:
            return None
        return min(1.0, max(0.0, 1.0 - self.kv_blocks_free / self.kv_blocks_total))

    @property
    def queue_per_engine(self) -> float:
        return self.queue_depth / self.engines


def pool_load(reports: tuple[EngineReport, ...] | None, role: str) -> PoolLoad | None:
    """The total of ``role``'s engines in ``reports``; ``None`` when the router relays no
    engine load (``reports`` is ``None``) or none of that role."""
    if reports is None:
        return None
    pool = [report for report in reports if report.role == role]
    if not pool:
        return None
    return PoolLoad(
        engines=len(pool),
        queue_depth=sum(report.queue_depth for report in pool),
        running_requests=sum(report.running_requests for report in pool),
        kv_blocks_free=sum(report.kv_blocks_free for report in pool),
        kv_blocks_total=sum(report.kv_blocks_total for report in pool),
    )


@dataclass(frozen=True)
class RouterSnapshot:
    """The cumulative figures of one scrape, at ``at_s`` (the planner's monotonic clock)."""

    at_s: float
    requests: float
    ttft_sum_s: float
    ttft_count: float
    itl_sum_s: float
    itl_count: float
    ready_prefill: int | None
    ready_decode: int | None
    prompt_tokens: tuple[float, float] | None = None
    """``(sum, count)`` of the prompt-token histogram; ``None`` when the router has none."""
    generation_tokens: tuple[float, float] | None = None
    """``(sum, count)`` of the generated-token histogram; ``None`` as ``prompt_tokens``."""
    prefill_cached_tokens: tuple[float, float] | None = None
    """``(sum, count)`` of the prefill pool's cached-token histogram; ``None`` as above."""
    engine_loads: tuple[EngineReport, ...] | None = None
    """Each engine's relayed load, sorted by engine and role; ``None`` when the router exports
    no ``pdserve_router_engine_load`` (empty: it does, but has no engine)."""

    def pool_load(self, role: str) -> PoolLoad | None:
        """``role``'s engines' load at this read (:func:`pool_load`)."""
        return pool_load(self.engine_loads, role)


@dataclass(frozen=True)
class Interval:
    """What happened between two snapshots: arrivals a second, and the mean TTFT and ITL of
    what was observed in it (``None`` when nothing was)."""

    duration_s: float
    rate_rps: float
    ttft_ms: float | None
    itl_ms: float | None
    input_tokens: float | None = None
    """Mean prompt length of the requests that finished in it (``None``: none did, or the
    router counts no tokens)."""
    output_tokens: float | None = None
    """Mean generated length, as ``input_tokens``."""
    cached_tokens: float | None = None
    """Mean prompt tokens found cached per request placed on the prefill pool in it."""


def parse_router_metrics(text: str, at_s: float) -> RouterSnapshot:
    """The snapshot in a router's exposition ``text``; :class:`MetricsUnreadable` when it is
    not Prometheus text or lacks the request counter (not a router's)."""
    totals: dict[str, float] = {}
    ready: dict[str, int] = {}
    loads: dict[tuple[str, str], dict[str, float]] = {}
    found: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            if family.name == REQUESTS.removesuffix("_total"):
                found.add(REQUESTS)  # declared even before the first request
            elif family.name == ENGINE_LOAD:
                found.add(ENGINE_LOAD)  # declared even before the first engine
            for sample in family.samples:
                name = sample.name
                if name == REQUESTS:
                    totals[REQUESTS] = totals.get(REQUESTS, 0.0) + sample.value
                elif name in _SUMMED or (
                    # the prefill pool's only: what its engines need not compute
                    name in _CACHED_PARTS and sample.labels.get("pool") == "prefill"
                ):
                    totals[name] = totals.get(name, 0.0) + sample.value
                elif name == READY_ENGINES:
                    role = sample.labels.get("role", "")
                    ready[role] = int(sample.value)
                elif name == ENGINE_LOAD and sample.labels.get("kind") in LOAD_KINDS:
                    key = (sample.labels.get("engine", ""), sample.labels.get("role", ""))
                    loads.setdefault(key, {})[sample.labels["kind"]] = sample.value
    except ValueError as exc:
        raise MetricsUnreadable(f"router metrics are not Prometheus text: {exc}") from exc
    if REQUESTS not in found:
        raise MetricsUnreadable(f"router metrics have no {REQUESTS}: not a pdserve router?")
    return RouterSnapshot(
        at_s=at_s,
        requests=totals.get(REQUESTS, 0.0),
        ttft_sum_s=totals.get(f"{TTFT}_sum", 0.0),
        ttft_count=totals.get(f"{TTFT}_count", 0.0),
        itl_sum_s=totals.get(f"{ITL}_sum", 0.0),
        itl_count=totals.get(f"{ITL}_count", 0.0),
        ready_prefill=ready.get("prefill"),
        ready_decode=ready.get("decode"),
        prompt_tokens=_sum_count(totals, PROMPT_TOKENS),
        generation_tokens=_sum_count(totals, GENERATION_TOKENS),
        prefill_cached_tokens=_sum_count(totals, CACHED_TOKENS),
        engine_loads=(
            tuple(EngineReport(e, r, **kinds) for (e, r), kinds in sorted(loads.items()))
            if ENGINE_LOAD in found
            else None
        ),
    )


def _sum_count(totals: dict[str, float], family: str) -> tuple[float, float] | None:
    if f"{family}_count" not in totals:
        return None
    return totals.get(f"{family}_sum", 0.0), totals[f"{family}_count"]


def interval_between(before: RouterSnapshot, after: RouterSnapshot) -> Interval | None:
    """The interval from ``before`` to ``after``; ``None`` when a counter went down (the router
    restarted: the next interval starts from ``after``) or no time passed."""
    duration = after.at_s - before.at_s
    deltas = (
        after.requests - before.requests,
        after.ttft_count - before.ttft_count,
        after.itl_count - before.itl_count,
    )
    if duration <= 0 or min(deltas) < 0:
        return None
    requests, ttft_count, itl_count = deltas
    return Interval(
        duration_s=duration,
        rate_rps=requests / duration,
        ttft_ms=_mean_ms(after.ttft_sum_s - before.ttft_sum_s, ttft_count),
        itl_ms=_mean_ms(after.itl_sum_s - before.itl_sum_s, itl_count),
        input_tokens=_mean_tokens(before.prompt_tokens, after.prompt_tokens),
        output_tokens=_mean_tokens(before.generation_tokens, after.generation_tokens),
        cached_tokens=_mean_tokens(before.prefill_cached_tokens, after.prefill_cached_tokens),
    )


def _mean_tokens(
    before: tuple[float, float] | None, after: tuple[float, float] | None
) -> float | None:
    if before is None or after is None:
        return None
    count = after[1] - before[1]
    return (after[0] - before[0]) / count if count > 0 else None


def _mean_ms(sum_s: float, count: float) -> float | None:
    return sum_s / count * 1000 if count > 0 else None
