"""Prometheus metrics of the KV data plane, created per instance with an injectable registry.

Every family is labelled by the producer engine, the consumer engine and the rank pair
(``producer_rank="pp0tp1"``, ``consumer_rank="pp0tp0"``) where both are known; lease expiry is
seen by the producer alone, which does not know which consumer ranks stayed silent, so it carries
``consumer_engine`` (``unknown`` when none notified) but no ``consumer_rank``.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from services.control_plane.wire import EngineId
from services.kv_transfer.protocol import rank_label
from services.kv_transfer.transport import FailedRead, PeerTransferStats
from services.metrics import LATENCY_BUCKETS_S, Metrics
from services.topology.ranges import RankKey

_PREP_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2)
_DESCRIPTOR_BUCKETS = (1, 8, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
_PAIR = ["producer_engine", "consumer_engine", "producer_rank", "consumer_rank"]


@dataclass(frozen=True)
class RankPair:
    """The label values of one (producer worker, consumer worker) pair."""

    producer_engine: EngineId
    consumer_engine: EngineId
    producer_rank: RankKey
    consumer_rank: RankKey

    def labels(self) -> dict[str, str]:
        return {
            "producer_engine": self.producer_engine,
            "consumer_engine": self.consumer_engine,
            "producer_rank": rank_label(self.producer_rank),
            "consumer_rank": rank_label(self.consumer_rank),
        }


class KVTransferMetrics(Metrics):
    """``pdserve_kv_transfer_*`` metrics. Tests pass a fresh ``CollectorRegistry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.transfer_latency = self.histogram(
            "pdserve_kv_transfer_latency_seconds",
            "From posting a read to one producer worker to its completion.",
            _PAIR,
            buckets=LATENCY_BUCKETS_S,
        )
        self.transferred_bytes = self.counter(
            "pdserve_kv_transfer_bytes_total",
            "KV bytes read successfully.",
            _PAIR,
        )
        self.descriptors = self.histogram(
            "pdserve_kv_transfer_descriptors",
            "Descriptors (layer x K/V x block ranges) per read from one producer worker.",
            _PAIR,
            buckets=_DESCRIPTOR_BUCKETS,
        )
        self.descriptor_prep = self.histogram(
            "pdserve_kv_transfer_descriptor_prep_seconds",
            "Per-request descriptor cost of one read: index arithmetic plus make_prepped_xfer.",
            _PAIR,
            buckets=_PREP_BUCKETS,
        )
        self.peer_prepare = self.histogram(
            "pdserve_kv_transfer_peer_prepare_seconds",
            "Pre-warming one producer worker: adding its agent and preparing descriptor lists.",
            _PAIR,
            buckets=LATENCY_BUCKETS_S,
        )
        self.failures = self.counter(
            "pdserve_kv_transfer_failures_total",
            "Reads that failed, by reason (timeout, remote_disconnected, stale_generation...).",
            [*_PAIR, "reason"],
        )
        self.recomputes = self.counter(
            "pdserve_kv_transfer_recomputes_total",
            "Failed reads whose blocks the consumer recomputes instead of failing the request.",
            _PAIR,
        )
        self.expired_leases = self.counter(
            "pdserve_kv_transfer_expired_leases_total",
            "Producer leases that expired before every expected consumer rank notified.",
            ["producer_engine", "consumer_engine", "producer_rank"],
        )
        self.released = self.counter(
            "pdserve_kv_transfer_released_total",
            "Requests whose producer blocks were freed at once, before any read, because no "
            "consumer will read them, by reason (consumer_holds_prompt: the consumer's prefix "
            "cache held every block; push_failed: the push failed and the request goes on "
            "elsewhere; consumer_gone: the router aborted the request, no consumer will come).",
            ["producer_engine", "consumer_engine", "reason"],
        )
        self.notifications = self.counter(
            "pdserve_kv_transfer_notifications_total",
            "Completion notifications received by producers, by outcome (counted, duplicate, "
            "unknown_request, foreign_engine, failed).",
            [*_PAIR, "outcome"],
        )
        self.notification_send_failures = self.counter(
            "pdserve_kv_transfer_notification_send_failures_total",
            "Completion notifications a consumer could not send (the producer frees on lease "
            "expiry instead).",
            _PAIR,
        )
        self.rejected_notifications = self.counter(
            "pdserve_kv_transfer_rejected_notifications_total",
            "Notifications dropped because they did not decode.",
            ["producer_engine", "producer_rank"],
        )
        self.duplicate_reports = self.counter(
            "pdserve_kv_transfer_duplicate_reports_total",
            "Per-rank completion reports received twice for one request (a contract breach).",
            ["consumer_engine", "consumer_rank"],
        )
        self.prewarm_failures = self.counter(
            "pdserve_kv_transfer_prewarm_failures_total",
            "Producer engines that turned READY but could not be pre-warmed, by reason.",
            ["producer_engine", "reason"],
        )
        self.leased_blocks = self.gauge(
            "pdserve_kv_transfer_leased_blocks",
            "Blocks a producer worker holds for consumers to read.",
            ["producer_engine", "producer_rank"],
        )

    def observe_transfer(self, pair: RankPair, stats: PeerTransferStats) -> None:
        labels = pair.labels()
        self.transfer_latency.labels(**labels).observe(stats.seconds)
        self.transferred_bytes.labels(**labels).inc(stats.nbytes)
        self.descriptors.labels(**labels).observe(stats.descriptors)
        self.descriptor_prep.labels(**labels).observe(stats.prep_seconds)

    def observe_failure(self, pair: RankPair, failure: FailedRead, *, recompute: bool) -> None:
        self.failures.labels(**pair.labels(), reason=failure.reason).inc()
        if recompute:
            self.recomputes.labels(**pair.labels()).inc()

    def observe_notification(self, pair: RankPair, outcome: str) -> None:
        self.notifications.labels(**pair.labels(), outcome=outcome).inc()

    def declare_producer(self, producer_engine: EngineId, producer_rank: RankKey) -> None:
        """Export the expired-lease series of a producer worker at 0 before its first expiry
        (the usual one: no consumer ever read, ``consumer_engine="unknown"``), so that
        ``increase()`` and the lease alert see the first expiry as a change, not as a new series
        that starts at 1."""
        self.expired_leases.labels(
            producer_engine=producer_engine,
            consumer_engine="unknown",
            producer_rank=rank_label(producer_rank),
        )

    def observe_expired(
        self, producer_engine: EngineId, producer_rank: RankKey, consumer_engine: EngineId | None
    ) -> None:
        self.expired_leases.labels(
            producer_engine=producer_engine,
            consumer_engine=consumer_engine or "unknown",
            producer_rank=rank_label(producer_rank),
        ).inc()
