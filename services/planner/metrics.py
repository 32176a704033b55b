"""Prometheus metrics of the planner (docs/metrics.md, "Planner", is the contract)."""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry

from services.metrics import Metrics
from services.planner.decision import REASONS
from services.planner.observe import PoolLoad

POOLS = ("prefill", "decode")


class PlannerMetrics(Metrics):
    """``pdserve_planner_*``, created with an injectable registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        super().__init__(registry)
        self.desired_replicas = self.gauge(
            "pdserve_planner_desired_replicas",
            "Engines the planner wants in each pool (after bounds and stabilisation).",
            ["pool"],
        )
        self.needed_replicas = self.gauge(
            "pdserve_planner_needed_replicas",
            "Engines each pool needs for the predicted load at the SLOs (before bounds).",
            ["pool"],
        )
        self.correction = self.gauge(
            "pdserve_planner_correction_ratio",
            "Observed over expected latency of each pool (TTFT for prefill, ITL for decode), "
            "clamped; the SLO is divided by it.",
            ["pool"],
        )
        self.predicted_rate = self.gauge(
            "pdserve_planner_predicted_requests_per_second",
            "Requests a second predicted for the next interval.",
        )
        self.predicted_input = self.gauge(
            "pdserve_planner_predicted_input_tokens",
            "Mean prompt length predicted for the next interval.",
        )
        self.predicted_output = self.gauge(
            "pdserve_planner_predicted_output_tokens",
            "Mean generated length predicted for the next interval.",
        )
        self.decisions = self.counter(
            "pdserve_planner_decisions_total",
            "Decisions per pool by reason (scale_up, scale_down, hold, hold_stabilizing, "
            "at_min, at_max, no_metrics).",
            ["pool", "reason"],
        )
        for pool in POOLS:
            for reason in REASONS:
                self.decisions.labels(pool=pool, reason=reason)
        self.queued_requests = self.gauge(
            "pdserve_planner_queued_requests",
            "Requests waiting in each pool's engines at the last read (the router's relay of "
            "their queue_depth, summed over the pool); absent when not relayed.",
            ["pool"],
        )
        self.kv_usage = self.gauge(
            "pdserve_planner_kv_usage_ratio",
            "KV blocks in use over the KV blocks of each pool's engines at the last read; "
            "absent when not relayed or no engine reports KV capacity.",
            ["pool"],
        )
        self.lengths_from_settings = self.counter(
            "pdserve_planner_lengths_from_settings_total",
            "Intervals planned with the mean prompt and generated lengths of the settings "
            "(--input-tokens, --output-tokens) because the router had not measured them "
            "(it exports no token figures, or no request has finished yet).",
        )

    def set_load(self, pool: str, load: PoolLoad | None) -> None:
        """``pool``'s engines' queue and KV usage, or no series when the figure is unknown."""
        usage = None if load is None else load.kv_usage
        for gauge, value in (
            (self.queued_requests, None if load is None else load.queue_depth),
            (self.kv_usage, usage),
        ):
            if value is None:
                with contextlib.suppress(KeyError):
                    gauge.remove(pool)
            else:
                gauge.labels(pool=pool).set(value)
