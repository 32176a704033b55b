"""Metrics of a reference engine: the host's own counters and a relay of the ranks' metrics.

Rank processes own the KV data plane, so the ``pdserve_kv_transfer_*`` families
(:class:`~services.kv_transfer.metrics.KVTransferMetrics`) live in their registries. Instead of
``prometheus_client``'s multiprocess mode (which needs ``PROMETHEUS_MULTIPROC_DIR`` set before
``prometheus_client`` is imported in every process, and rewrites gauges with a ``pid`` label),
each rank sends its families to the host every ``metrics_interval_s`` and once more when it
stops (:class:`~services.engines.reference.messages.MetricsSnapshot`). :class:`RankMetricsRelay`
is a collector that serves the latest snapshot of every rank, merged into one family per name
(ranks label their samples with their rank, so samples rarely collide; where they do, as for
PeerSync's per-engine pre-warm failures, the values are summed). Register it in the registry the
service exposes (``ReferenceBackend.metrics_collector()``). Figures lag by at most one interval.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from services.metrics import Metrics
from services.topology.ranges import RankKey


class RankMetricsRelay(Collector):
    """The latest metric families of each rank of one engine, served as one collector."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_rank: dict[RankKey, tuple[Metric, ...]] = {}

    def update(self, rank: RankKey, families: Iterable[object]) -> None:
        """Replace ``rank``'s snapshot (called by the engine's host thread)."""
        metrics = tuple(f for f in families if isinstance(f, Metric))
        with self._lock:
            self._by_rank[rank] = metrics

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            snapshots = [self._by_rank[rank] for rank in sorted(self._by_rank)]
        merged: dict[str, Metric] = {}
        values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], int]] = {}
        for families in snapshots:
            for family in families:
                target = merged.get(family.name)
                if target is None:
                    target = Metric(family.name, family.documentation, family.type, family.unit)
                    merged[family.name] = target
                    values[family.name] = {}
                index = values[family.name]
                for sample in family.samples:
                    key = (sample.name, tuple(sorted(sample.labels.items())))
                    at = index.get(key)
                    if at is None:
                        index[key] = len(target.samples)
                        target.samples.append(sample)
                    else:
                        old = target.samples[at]
                        if sample.name.endswith("_created"):  # a timestamp: keep the first
                            value = min(old.value, sample.value)
                        else:
                            value = old.value + sample.value
                        target.samples[at] = old._replace(value=value)
        yield from merged.values()


class ReferenceEngineMetrics(Metrics):
    """The host-side counters of one reference engine (``pdserve_reference_engine_*``).

    The service's ``pdserve_engine_*`` families (queue depth, requests by outcome...) are the
    engine service's; these count what only the backend sees: how requests ended, why KV pulls
    were refused or failed (by the error class they map to), and how held KV was let go.
    """

    def __init__(self, engine_id: str, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self._engine = engine_id
        self._finished = self.counter(
            "pdserve_reference_engine_finished_total",
            "Requests that ended, by kind (prefill, generate, remote) and finish reason.",
            ["engine", "kind", "finish_reason"],
        )
        self._kv_errors = self.counter(
            "pdserve_reference_engine_kv_errors_total",
            "Disaggregated requests refused or failed on their KV, by error class and reason.",
            ["engine", "error", "reason"],
        )
        self._held = self.counter(
            "pdserve_reference_engine_held_kv_total",
            "Prefilled requests whose held KV was let go, by outcome (released, expired, aborted).",
            ["engine", "outcome"],
        )

    def finished(self, kind: str, finish_reason: str) -> None:
        self._finished.labels(engine=self._engine, kind=kind, finish_reason=finish_reason).inc()

    def kv_error(self, error: str, reason: str) -> None:
        self._kv_errors.labels(engine=self._engine, error=error, reason=reason).inc()

    def held_ended(self, outcome: str) -> None:
        self._held.labels(engine=self._engine, outcome=outcome).inc()

    def value(self, name: str, **labels: str) -> float:
        """A sample's value (0 when never set): for tests and the benchmark."""
        found = self.registry.get_sample_value(name, {"engine": self._engine, **labels})
        return 0.0 if found is None else found
