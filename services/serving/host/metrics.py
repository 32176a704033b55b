"""``pdserve_engine_*``: the engine service's own metrics (see docs/metrics.md).

Created once by the host with an injectable registry (tests pass a fresh one). Load gauges are
refreshed from ``backend.load()`` on every heartbeat and every GetLoad.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.control_plane.wire import EngineLoad
from services.metrics import Metrics

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class EngineServiceMetrics(Metrics):
    """The engine service's series, labelled with its engine id and role."""

    def __init__(self, registry: CollectorRegistry, engine_id: str, role: str) -> None:
        super().__init__(registry)
        self.engine_id = engine_id
        self.role = role
        labels = ("engine", "role")
        self.queue_depth = self.gauge(
            "pdserve_engine_queue_depth",
            "Requests waiting for admission.",
            labels,
        )
        self.running_requests = self.gauge(
            "pdserve_engine_running_requests",
            "Requests admitted and not finished.",
            labels,
        )
        self.kv_blocks_free = self.gauge("pdserve_engine_kv_blocks_free", "KV blocks free.", labels)
        self.kv_blocks_total = self.gauge(
            "pdserve_engine_kv_blocks_total", "KV blocks in the pool.", labels
        )
        self.requests = self.counter(
            "pdserve_engine_requests",
            "RPCs served, by outcome (ok, aborted, or the gRPC status code name).",
            ("engine", "role", "rpc", "outcome"),
        )
        self.prefill_seconds = self.histogram(
            "pdserve_engine_prefill_seconds",
            "Engine time from admission to the first token.",
            ("engine",),
            buckets=_LATENCY_BUCKETS,
        )
        self.kv_pull_seconds = self.histogram(
            "pdserve_engine_kv_pull_seconds",
            "Time a disaggregated decode request spent pulling its KV (whole request).",
            ("engine",),
            buckets=_LATENCY_BUCKETS,
        )
        self.handshake_ranks_published = self.gauge(
            "pdserve_engine_handshake_ranks_published",
            "1 once the (pp, tp) rank published its handshake record.",
            ("engine", "rank"),
        )
        self.drain_aborted = self.counter(
            "pdserve_engine_drain_aborted",
            "Requests a drain had to abort because they did not finish within the bound.",
            labels,
        )

        self.heartbeat_failures = self.counter(
            "pdserve_engine_heartbeat_failures",
            "Heartbeats that failed and were retried at the next interval, by the control "
            "plane's reason (unavailable while Redis is down; engine_not_found when the "
            "registration was lost and the engine registers again).",
            ("engine", "role", "reason"),
        )
        self.reregistrations = self.counter(
            "pdserve_engine_reregistrations",
            "Times the engine registered again under a new generation after the control plane "
            "lost its registration (Redis restarted without persistence, or the lease expired), "
            "and turned READY again.",
            labels,
        )
        self.registration_restores = self.counter(
            "pdserve_engine_registration_restores",
            "Times the lease ran out while the engine was starting (its host stalled past the "
            "TTL) and the host registered it again under the same generation.",
            labels,
        )
        self.reregistration_failures = self.counter(
            "pdserve_engine_reregistration_failures",
            "Re-registration attempts that failed and were retried, by reason.",
            ("engine", "role", "reason"),
        )
        self.producer_check_fallbacks = self.counter(
            "pdserve_engine_producer_check_fallbacks",
            "Producer checks the control plane could not answer (Redis unavailable), by "
            "outcome: last_known (answered from the producer's view read at most "
            "producer_view_max_stale_s ago) or refused (no such view: ProducerUnavailable).",
            ("engine", "role", "outcome"),
        )

    def observe_load(self, load: EngineLoad) -> None:
        labels = (self.engine_id, self.role)
        self.queue_depth.labels(*labels).set(load.queue_depth)
        self.running_requests.labels(*labels).set(load.running_requests)
        self.kv_blocks_free.labels(*labels).set(load.kv_blocks_free)
        self.kv_blocks_total.labels(*labels).set(load.kv_blocks_total)

    def count_request(self, rpc: str, outcome: str) -> None:
        self.requests.labels(self.engine_id, self.role, rpc, outcome).inc()

    def count_drain_aborted(self, count: int) -> None:
        self.drain_aborted.labels(self.engine_id, self.role).inc(count)

    def rank_published(self, pp_rank: int, tp_rank: int) -> None:
        self.handshake_ranks_published.labels(self.engine_id, f"{pp_rank}:{tp_rank}").set(1)

    def count_heartbeat_failure(self, reason: str) -> None:
        self.heartbeat_failures.labels(self.engine_id, self.role, reason).inc()

    def count_reregistration(self) -> None:
        self.reregistrations.labels(self.engine_id, self.role).inc()

    def count_registration_restore(self) -> None:
        self.registration_restores.labels(self.engine_id, self.role).inc()

    def count_reregistration_failure(self, reason: str) -> None:
        self.reregistration_failures.labels(self.engine_id, self.role, reason).inc()

    def count_producer_check_fallback(self, outcome: str) -> None:
        self.producer_check_fallbacks.labels(self.engine_id, self.role, outcome).inc()
