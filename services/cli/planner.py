"""``pdserve planner``: the prefill:decode planner's decisions, published and printed.

It reads the router's ``/metrics`` every interval and says how many engines each pool needs
for ``--ttft-ms`` and ``--itl-ms``; it does not start or stop engines (``pdserve up
--autoscale`` and the chart's autoscalers act on what it publishes). Settings come from
``PDSERVE_PLANNER_...`` (:class:`services.planner.config.PlannerSettings`); flags override
them. The planner's modules are imported only when it runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from pydantic import ValidationError

from services.cli.settings import flag_values

if TYPE_CHECKING:
    from services.planner.config import PlannerSettings

_FLAGS = (
    "router_url", "router_discovery", "router_metrics_ports", "profile", "prefill_layout",
    "decode_layout", "ttft_ms", "itl_ms", "interval_s", "predictor", "ema_alpha",
    "input_tokens", "output_tokens", "prefill_min", "prefill_max", "decode_min", "decode_max",
    "stabilization_intervals", "kv_usage_limit", "prefill_queue_limit", "cached_tokens",
    "metrics_host", "metrics_port",
)  # fmt: skip

HELP = (
    "print and publish how many prefill and decode engines the SLOs need (decides only: it "
    "does not start or stop engines)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router-url", help="the router whose /metrics is read")
    parser.add_argument(
        "--router-discovery",
        choices=("url", "dns"),
        help="url: that one router; dns: every address its host resolves to (a headless "
        "Service's router pods), added up",
    )
    parser.add_argument(
        "--router-metrics-port",
        dest="router_metrics_ports",
        type=int,
        action="append",
        metavar="PORT",
        help="with dns: a port read on every router address (repeat: one per router worker "
        "process, `pdserve router --workers`); default: the URL's port",
    )
    parser.add_argument("--profile", metavar="NAME|PATH", help="the engines' timing profile")
    for pool in ("prefill", "decode"):
        parser.add_argument(
            f"--{pool}-layout",
            metavar="PPxTP",
            help=f"the {pool} engines' layout (default 1x1); the profile must be of it",
        )
    parser.add_argument("--ttft-ms", type=float, help="time-to-first-token SLO (mean, ms)")
    parser.add_argument("--itl-ms", type=float, help="inter-token latency SLO (mean, ms)")
    parser.add_argument("--interval-s", type=float, help="seconds between decisions")
    parser.add_argument("--predictor", choices=("constant", "ema"), help="load predictor")
    parser.add_argument("--ema-alpha", type=float, help="weight of the newest interval (ema)")
    parser.add_argument(
        "--input-tokens",
        type=float,
        help="mean prompt length until the router has measured it",
    )
    parser.add_argument(
        "--output-tokens", type=float, help="mean generated length until the router has"
    )
    for pool in ("prefill", "decode"):
        parser.add_argument(f"--{pool}-min", type=int, help=f"fewest {pool} engines (>= 1)")
        parser.add_argument(f"--{pool}-max", type=int, help=f"most {pool} engines")
    parser.add_argument(
        "--stabilization-intervals",
        type=int,
        help="a pool goes down only after needing fewer for this many intervals",
    )
    parser.add_argument(
        "--kv-usage-limit",
        type=float,
        help="decode pool KV usage (0..1] above which it needs one engine more (default 0.9; "
        "1: off)",
    )
    parser.add_argument(
        "--prefill-queue-limit",
        type=float,
        help="requests waiting per prefill engine above which that pool needs one engine more "
        "(default: what --ttft-ms allows for the profile's prefill of the mean prompt)",
    )
    parser.add_argument(
        "--cached-tokens",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="size the prefill pool for the uncached part of prompts, as the router counts "
        "it (default); --no-cached-tokens: as if every prompt token were computed",
    )
    parser.add_argument("--metrics-host", help="address of the planner's own /metrics")
    parser.add_argument(
        "--metrics-port", type=int, help="port of the planner's own /metrics (0: a free one)"
    )


def build_settings(args: argparse.Namespace) -> PlannerSettings:
    """Environment settings with the flags on top (``ValidationError`` when they disagree)."""
    from services.planner.config import PlannerSettings  # noqa: PLC0415

    base = PlannerSettings()
    return PlannerSettings.model_validate({**base.model_dump(), **flag_values(args, _FLAGS)})


def run(args: argparse.Namespace) -> int:
    from services.planner.errors import PlannerConfigError  # noqa: PLC0415
    from services.planner.main import run as run_planner  # noqa: PLC0415

    try:
        settings = build_settings(args)
    except ValidationError as exc:
        print(f"pdserve planner: invalid settings: {exc}", file=sys.stderr)
        return 2
    try:
        return run_planner(settings)
    except PlannerConfigError as exc:
        print(f"pdserve planner: {exc}", file=sys.stderr)
        return 2
