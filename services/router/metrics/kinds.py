"""The router's own kinds of metric, beside ``prometheus_client``'s: what the request path
observes without a lock (:class:`LoopHistogram`, :class:`Children`) and what is read from the
engine pool when ``/metrics`` is scraped (:class:`CircuitGauge`, :class:`InflightGauge`).
:class:`~services.router.metrics.RouterMetrics` declares the families; nothing here names one
but the two gauges that are read from the pool.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

M = TypeVar("M", bound=Counter)

InflightSamples = Callable[[], Iterable[tuple[str, str, int]]]
"""``(engine, role, requests in flight)`` of every READY engine, read at scrape time."""

CircuitSamples = Callable[[], Iterable[tuple[str, str, str]]]
"""``(engine, role, breaker state)`` of every READY engine, read at scrape time."""


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


class CircuitGauge(Collector):
    """``pdserve_router_engine_circuit_state``: 1 for each READY engine's current breaker
    state and 0 for its other states, read from the engine pool when scraped."""

    NAME = "pdserve_router_engine_circuit_state"
    DOCUMENTATION = (
        "Circuit-breaker state of each READY engine as this router sees it (1 for the "
        "current state: closed, open, half_open)."
    )

    def __init__(self) -> None:
        self._source: CircuitSamples = tuple
        self._states: tuple[str, ...] = ()

    def read_from(self, source: CircuitSamples, states: tuple[str, ...]) -> None:
        """Set by the engine pool when it is built: the samples and every state a breaker
        can be in (:class:`~services.router.scheduling.health.CircuitState`)."""
        self._source = source
        self._states = states

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            self.NAME, self.DOCUMENTATION, labels=("engine", "role", "state")
        )
        for engine, role, current in self._source():
            for state in self._states:
                family.add_metric((engine, role, state), 1 if state == current else 0)
        yield family


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
    """A histogram observed on the request path: a bucket index by bisection and two list
    updates, no lock (``prometheus_client.Histogram`` takes two locks and scans its bounds in
    Python per observation: about 6% of the router's CPU on a 64-token stream for the ITL, and
    its six observations per request showed on a non-streamed one). Only for the event loop's
    thread, which also serves ``/metrics``; exposed as a ``prometheus_client`` histogram is
    (cumulative ``le`` buckets, ``+Inf``, ``_sum``, ``_count``; no ``_created``). With
    ``labelnames``, :meth:`labels` gives each label set's child, made once (label values are
    bounded on the request path); without, :meth:`observe` is the one series'."""

    def __init__(
        self,
        name: str,
        documentation: str,
        buckets: Sequence[float],
        labelnames: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.documentation = documentation
        self._bounds = tuple(float(bound) for bound in buckets)
        self._labelnames = tuple(labelnames)
        self._children: dict[tuple[str, ...], _LoopSeries] = {}
        self._only = None if self._labelnames else self.labels()

    def observe(self, amount: float) -> None:
        """Observe ``amount`` on the unlabelled histogram's one series."""
        if self._only is None:
            raise ValueError(f"{self.name} has labels {self._labelnames}: observe a child's")
        self._only.observe(amount)

    def labels(self, *values: str) -> _LoopSeries:
        """The series of ``values`` (the label values in declared order), made on first use."""
        series = self._children.get(values)
        if series is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self.name} takes labels {self._labelnames}, got {values!r}")
            series = self._children[values] = _LoopSeries(self._bounds)
        return series

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(self.name, self.documentation, labels=self._labelnames)
        for values, series in self._children.items():
            cumulative = 0
            buckets: list[tuple[str, float]] = []
            for bound, count in zip((*self._bounds, float("inf")), series.counts, strict=True):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            family.add_metric(list(values), buckets, series.total)
        yield family


class _LoopSeries:
    """One label set's buckets and sum (see :class:`LoopHistogram`)."""

    __slots__ = ("_bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.total = 0.0

    def observe(self, amount: float) -> None:
        self.counts[bisect_left(self._bounds, amount)] += 1
        self.total += amount


def _le(bound: float) -> str:
    """A bucket's ``le`` label as ``prometheus_client`` writes it (``0.5``, ``1.0``, ``+Inf``)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))
