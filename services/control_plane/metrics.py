"""Prometheus metrics of the control plane, created per instance with an injectable registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from services.metrics import Metrics

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ControlPlaneMetrics(Metrics):
    """``pdserve_control_plane_*`` metrics. Tests pass a fresh ``CollectorRegistry``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.records_rejected = self.counter(
            "pdserve_control_plane_records_rejected_total",
            "Handshake or engine values refused by validation, by reason "
            "(oversized, malformed, wrong_version, hash_mismatch, layer_gap...).",
            ["reason"],
        )
        self.redis_retries = self.counter(
            "pdserve_control_plane_redis_retries_total",
            "Redis commands retried after a transient failure.",
            ["operation"],
        )
        self.redis_errors = self.counter(
            "pdserve_control_plane_redis_errors_total",
            "Redis commands that failed after every retry.",
            ["operation"],
        )
        self.leases_expired = self.counter(
            "pdserve_control_plane_leases_expired_total",
            "Engines seen gone because their lease expired without deregistration.",
        )
        self.readiness_latency = self.histogram(
            "pdserve_control_plane_readiness_latency_seconds",
            "From an engine's registration to its READY announcement.",
            ["engine"],
            buckets=_LATENCY_BUCKETS,
        )
        self.handshakes_published = self.counter(
            "pdserve_control_plane_handshakes_published_total",
            "Per-worker handshake records published.",
            ["engine"],
        )
        self.engine_state = self.gauge(
            "pdserve_control_plane_engine_state",
            "1 for the state each known engine is in (pending, ready, invalid).",
            ["engine", "state"],
        )
        self.watch_resyncs = self.counter(
            "pdserve_control_plane_watch_resyncs_total",
            "Full re-reads by watchers, by cause (start, reconnect, periodic).",
            ["cause"],
        )
