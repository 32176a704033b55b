"""Prometheus metrics of the router (docs/metrics.md, "Router", is the contract).

Created per instance with an injectable ``CollectorRegistry``: tests pass a fresh one.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from services.router.health import CircuitGauge

M = TypeVar("M", Counter, Histogram)

InflightSamples = Callable[[], Iterable[tuple[str, str, int]]]
"""``(engine, role, requests in flight)`` of every READY engine, read at scrape time."""

_LATENCY_BUCKETS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
)
_OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


FALLBACK_REASONS = ("no_prefill_engine", "prefill_circuit_open", "prefill_failed")
"""Every ``reason`` of ``pdserve_router_fallbacks_total``."""


class RouterMetrics:
    """``pdserve_router_*``; see docs/metrics.md for names and labels."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve_router_requests_total",
            "Requests answered, by endpoint and outcome (ok or the error code).",
            ["endpoint", "outcome"],
            registry=r,
        )
        self.execution_path = Counter(
            "pdserve_router_execution_path_total",
            "Requests by how they ran: disaggregated (prefill then decode engine), local "
            "(the decode engine prefilled itself) or retried (disaggregated after a failed "
            "prefill attempt).",
            ["path"],
            registry=r,
        )
        self.choices = Counter(
            "pdserve_router_choices_total",
            "Prompts with several choices (n > 1), by how their choices ran: forked (one "
            "prefill and one KV transfer, forked on the decode engine) or per_choice (a "
            "request per choice: an engine that cannot fork, or local execution).",
            ["path"],
            registry=r,
        )
        self.fallbacks = Counter(
            "pdserve_router_fallbacks_total",
            "Requests that ran differently from the plan, by reason (no_prefill_engine, "
            "prefill_circuit_open, prefill_failed).",
            ["reason"],
            registry=r,
        )
        # Exported at 0 from the start: the first fallback is then an increase that rate(),
        # increase() and the PdserveRouterFallbacks alert see (a series born at 1 is not).
        for reason in FALLBACK_REASONS:
            self.fallbacks.labels(reason=reason)
        self.prefill_retries = Counter(
            "pdserve_router_prefill_retries_total",
            "Prefill attempts that failed and were retried on another engine, by phase "
            "(connect, prefill: the Prefill call; kv_wait: the producer was gone before the "
            "decode engine pulled; kv_pull: the pull itself failed) and reason (the error code).",
            ["phase", "reason"],
            registry=r,
        )
        self.engine_timeouts = Counter(
            "pdserve_router_engine_timeouts_total",
            "Engine calls the router stopped waiting for, by call (prefill, decode) and bound: "
            "deadline (the whole call outlived prefill_timeout_s or decode_timeout_s) or idle "
            "(no decode delta within decode_idle_timeout_s).",
            ["call", "bound"],
            registry=r,
        )
        self.aborts = Counter(
            "pdserve_router_aborts_total",
            "Abort calls the router sent for a timed-out or orphaned request, by engine role "
            "and outcome: found, unknown (the engine no longer had it) or failed (the engine "
            "did not answer; its own cancellation or KV lease cleans up).",
            ["role", "outcome"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve_router_ttft_seconds",
            "Request arrival to its first token, by execution path.",
            ["path"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft_phase = Histogram(
            "pdserve_router_ttft_phase_seconds",
            "Parts of a disaggregated request's first tokens: prefill (the Prefill call), "
            "handoff (KV transfer reported by the decode engine), first_decode_token (the "
            "rest of the wait for the decode engine's first token).",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = LoopHistogram(
            "pdserve_router_itl_seconds",
            "Time between two token deltas of one streamed request (a non-streamed one's "
            "decode answers in one message: no gaps).",
            _LATENCY_BUCKETS,
        )
        r.register(self.itl)
        self.e2e = Histogram(
            "pdserve_router_e2e_latency_seconds",
            "Request arrival to its last byte, by endpoint.",
            ["endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pdserve_router_queue_time_seconds",
            "Request arrival to its first engine call (parsing, tokenizing, scheduling).",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            "pdserve_router_overhead_seconds",
            "Router time of a request excluding the time spent waiting on engine calls.",
            buckets=_OVERHEAD_BUCKETS,
            registry=r,
        )
        self.engine_inflight = InflightGauge()
        r.register(self.engine_inflight)
        self.engine_load = Gauge(
            "pdserve_router_engine_load",
            "Load each engine last reported through the control plane.",
            ["engine", "role", "kind"],
            registry=r,
        )
        self.ready_engines = Gauge(
            "pdserve_router_ready_engines",
            "READY engines the router can use, by role.",
            ["role"],
            registry=r,
        )
        self.migrations = Counter(
            "pdserve_router_migrations_total",
            "Requests whose decode continued on another engine pair after tokens had gone "
            "out (prompt plus the tokens so far re-prefilled), by reason (the decode error "
            "code).",
            ["reason"],
            registry=r,
        )
        self.circuit_trips = Counter(
            "pdserve_router_circuit_trips_total",
            "Circuit breakers opened: an engine's call failed through the engine's fault and "
            "the router stopped choosing it, by engine and role.",
            ["engine", "role"],
            registry=r,
        )
        self.circuit_state = CircuitGauge()
        r.register(self.circuit_state)
        self.engine_grpc_client = Gauge(
            "pdserve_router_engine_grpc_client",
            "The gRPC client of the router's engine calls: 1 for the one in use (h2: "
            "pdserve's own; grpcio: grpc.aio).",
            ["client"],
            registry=r,
        )
        # The request path's children (see Children).
        self.requests_by = Children(self.requests)
        self.execution_path_by = Children(self.execution_path)
        self.ttft_by = Children(self.ttft)
        self.ttft_phase_by = Children(self.ttft_phase)
        self.e2e_by = Children(self.e2e)


class Children(Generic[M]):
    """A metric's children by label values (in the declared order), each made once: the
    request path calls this instead of ``labels()``, which validates and locks on every call.
    Only for metrics whose children are never removed and whose label values are bounded."""

    def __init__(self, metric: M) -> None:
        self._metric: M = metric
        self._children: dict[tuple[str, ...], M] = {}

    def __call__(self, *values: str) -> M:
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child


class InflightGauge(Collector):
    """``pdserve_router_engine_inflight``, read from the engine pool when scraped (a request
    updates a plain counter on its engine slot, no metric)."""

    NAME = "pdserve_router_engine_inflight"
    DOCUMENTATION = "Requests this router has in flight on each engine (its reservations)."

    def __init__(self) -> None:
        self._source: InflightSamples = tuple

    def read_from(self, source: InflightSamples) -> None:
        """Set by the engine pool when it is built."""
        self._source = source

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(self.NAME, self.DOCUMENTATION, labels=("engine", "role"))
        for engine, role, inflight in self._source():
            family.add_metric((engine, role), inflight)
        yield family


class LoopHistogram(Collector):
    """An unlabelled histogram observed once per streamed token: a bucket index by bisection
    and two list updates, no lock (``prometheus_client.Histogram`` takes two locks and scans
    its bounds per observation, about 6% of the router's CPU on a 64-token stream). Only for
    the event loop's thread, which also serves ``/metrics``; exposed as a
    ``prometheus_client`` histogram is (cumulative ``le`` buckets, ``+Inf``, ``_sum``,
    ``_count``)."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(float(bound) for bound in buckets)
        self._counts = [0] * (len(self._bounds) + 1)  # the last is +Inf
        self._sum = 0.0

    def observe(self, amount: float) -> None:
        self._counts[bisect_left(self._bounds, amount)] += 1
        self._sum += amount

    def collect(self) -> Iterator[HistogramMetricFamily]:
        cumulative = 0
        buckets: list[tuple[str, float]] = []
        for bound, count in zip((*self._bounds, float("inf")), self._counts, strict=True):
            cumulative += count
            buckets.append((_le(bound), cumulative))
        yield HistogramMetricFamily(
            self.name, self.documentation, buckets=buckets, sum_value=self._sum
        )


def _le(bound: float) -> str:
    """A bucket's ``le`` label as ``prometheus_client`` writes it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))
