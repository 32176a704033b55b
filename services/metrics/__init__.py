"""Declaring Prometheus metrics: the one base every component's metrics class builds on.

A component's metrics are a class whose families live in one ``CollectorRegistry``: the one it
is given (a process shares one; tests pass a fresh one) or its own. :class:`Metrics` holds that
registry and declares families into it, so a family is its name, help, labels and buckets and
nothing else; a family of a component's own kind (a ``Collector`` read at scrape time, a
lock-free histogram) goes into the same registry through :meth:`Metrics.collector`. Names
follow ``pdserve_<component>_<what>_<unit>`` (docs/metrics.md is the contract).
No import from the rest of ``services``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.registry import Collector

LATENCY_BUCKETS_S = (
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
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)
"""Seconds, half a millisecond to 30 s: a KV read, a request's phase."""

C = TypeVar("C", bound=Collector)


class Metrics:
    """Families declared into one registry (see the module docstring)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, documentation, labels, registry=self.registry)

    def gauge(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, documentation, labels, registry=self.registry)

    def histogram(
        self,
        name: str,
        documentation: str,
        labels: Sequence[str] = (),
        *,
        buckets: Sequence[float],
    ) -> Histogram:
        return Histogram(name, documentation, labels, buckets=buckets, registry=self.registry)

    def collector(self, collector: C) -> C:
        """Register ``collector``, a family of the component's own kind, and return it."""
        self.registry.register(collector)
        return collector

    def value(self, name: str, **labels: str) -> float:
        """A sample's value in this registry (0 when never set): for tests and benchmarks."""
        found = self.registry.get_sample_value(name, labels)
        return 0.0 if found is None else found


__all__ = ["LATENCY_BUCKETS_S", "Metrics"]
