"""``pdserve planner``'s loop: read the router's figures every interval, plan, publish, print.

It decides and publishes; it does not start or stop engines: ``pdserve up --autoscale``
(:mod:`services.cli.up_autoscale`) acts on its figures locally, KEDA or an HPA through the
chart on Kubernetes. A planner that dies changes nothing: the pools keep the engines they
have.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import TextIO
from urllib.parse import urlsplit

import httpx
from prometheus_client import start_http_server

from services.engines.sim.profile import (
    SideLayout,
    SimProfile,
    SimProfileError,
    check_layout,
    check_model,
    load_profile,
)
from services.planner.config import PlannerSettings
from services.planner.decision import Bounds
from services.planner.errors import MetricsUnreadable, PlannerConfigError
from services.planner.fleet import Resolver, RouterFleet, read_fleet, resolve_addresses
from services.planner.metrics import PlannerMetrics
from services.planner.observe import RouterSnapshot, parse_router_metrics
from services.planner.plan import Planner, PlanStep, step_record
from services.planner.predictors import make_predictor
from services.planner.sizing import Slo
from services.serving.ready import format_ready_line

logger = logging.getLogger(__name__)


def build_planner(settings: PlannerSettings) -> Planner:
    """The planner ``settings`` describe; :class:`PlannerConfigError` for a bad profile."""
    try:
        profile = load_profile(settings.profile)
        for role, layout in (
            ("prefill", settings.prefill_layout),
            ("decode", settings.decode_layout),
        ):
            check_layout(profile, parse_layout(layout), role)
    except SimProfileError as exc:
        raise PlannerConfigError(str(exc)) from exc
    return Planner(
        profile,
        Slo(ttft_ms=settings.ttft_ms, itl_ms=settings.itl_ms),
        make_predictor(settings.predictor, settings.ema_alpha),
        prefill=Bounds(settings.prefill_min, settings.prefill_max),
        decode=Bounds(settings.decode_min, settings.decode_max),
        window=settings.stabilization_intervals,
        input_tokens=settings.input_tokens,
        output_tokens=settings.output_tokens,
        correction_range=(settings.correction_min, settings.correction_max),
        kv_usage_limit=settings.kv_usage_limit,
        prefill_queue_limit=settings.prefill_queue_limit,
        cached_tokens=settings.cached_tokens,
    )


def parse_layout(text: str) -> SideLayout:
    """``PPxTP`` (validated by the settings' pattern) as a layout."""
    pp, tp = text.split("x")
    return SideLayout(pp_size=int(pp), tp_size=int(tp))


def served_models(client: httpx.Client, settings: PlannerSettings) -> list[str]:
    """The models the router serves now (its ``/v1/models``); empty when it cannot say (not
    reachable, no engine READY yet): the check waits for a later interval."""
    headers = {}
    if settings.api_key is not None:
        headers["Authorization"] = f"Bearer {settings.api_key.get_secret_value()}"
    try:
        response = client.get(f"{settings.router_url}/v1/models", headers=headers)
        response.raise_for_status()
        return [str(model["id"]) for model in response.json()["data"]]
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
        logger.warning("planner: cannot read the router's models yet: %s", exc)
        return []


def check_served_model(
    client: httpx.Client, settings: PlannerSettings, profile: SimProfile
) -> bool:
    """Whether the router's models could be checked against ``profile``'s (``False``: not
    yet); :class:`PlannerConfigError` when it serves another model."""
    models = served_models(client, settings)
    if not models:
        return False
    try:
        check_model(profile, models)
    except SimProfileError as exc:
        raise PlannerConfigError(str(exc)) from exc
    return True


def scrape(client: httpx.Client, url: str) -> RouterSnapshot:
    """The router's figures now; :class:`MetricsUnreadable` when they cannot be had."""
    try:
        response = client.get(url)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise MetricsUnreadable(f"{url}: {exc}") from exc
    return parse_router_metrics(response.text, time.monotonic())


def router_reader(
    settings: PlannerSettings, client: httpx.Client, resolve: Resolver = resolve_addresses
) -> Callable[[], RouterSnapshot]:
    """What reads the router's figures each interval: ``<router_url>/metrics``, or with
    ``router_discovery="dns"`` every router the URL's host resolves to, added up."""
    if settings.router_discovery == "url":
        url = f"{settings.router_url}/metrics"
        return lambda: scrape(client, url)
    parts = urlsplit(settings.router_url)
    host = parts.hostname or ""
    ports = settings.router_metrics_ports or [
        parts.port or (443 if parts.scheme == "https" else 80)
    ]
    fleet = RouterFleet()

    def read() -> RouterSnapshot:
        snapshot, failures = read_fleet(
            fleet,
            parts.scheme,
            host,
            ports,
            lambda url: scrape(client, url),
            time.monotonic,
            resolve,
        )
        for address, why in failures.items():
            logger.warning("planner: router %s not read this interval: %s", address, why)
        return snapshot

    return read


def publish(metrics: PlannerMetrics, step: PlanStep) -> None:
    for pool, plan in (("prefill", step.prefill), ("decode", step.decode)):
        metrics.desired_replicas.labels(pool=pool).set(plan.decision.desired)
        metrics.needed_replicas.labels(pool=pool).set(plan.decision.needed)
        metrics.correction.labels(pool=pool).set(plan.correction)
        metrics.decisions.labels(pool=pool, reason=plan.decision.reason).inc()
        metrics.set_load(pool, plan.load)
    if step.lengths == "flags":
        metrics.lengths_from_settings.inc()
    if step.predicted is not None:
        metrics.predicted_rate.set(step.predicted.rate_rps)
        metrics.predicted_input.set(step.predicted.input_tokens)
        metrics.predicted_output.set(step.predicted.output_tokens)


def run(
    settings: PlannerSettings,
    *,
    stop: threading.Event | None = None,
    out: TextIO = sys.stdout,
    metrics: PlannerMetrics | None = None,
    resolve: Resolver = resolve_addresses,
) -> int:
    """Plan until ``stop`` is set (SIGTERM or SIGINT set it when this is the main thread).
    ``resolve`` finds the routers with ``router_discovery="dns"``."""
    planner = build_planner(settings)
    metrics = metrics if metrics is not None else PlannerMetrics()
    stop = stop if stop is not None else _stop_on_signals()
    try:
        server, _thread = start_http_server(
            settings.metrics_port, addr=settings.metrics_host, registry=metrics.registry
        )
    except OSError as exc:
        raise PlannerConfigError(
            f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port}: {exc}"
        ) from exc
    try:
        host = settings.metrics_host
        if host in ("0.0.0.0", "::", ""):
            host = "127.0.0.1"
        # The gauges exist from the start, at the bounds' view of the pools.
        publish_desired(metrics, planner)
        with httpx.Client(timeout=settings.scrape_timeout_s) as client:
            # A router already serving is checked before the planner says it is ready; one
            # that is not (no engine yet, not up) at the first interval it serves a model.
            model_checked = check_served_model(client, settings, planner.profile)
            print(
                format_ready_line({"metrics": f"http://{host}:{server.server_port}/metrics"}),
                file=out,
                flush=True,
            )
            read = router_reader(settings, client, resolve)
            while True:
                if not model_checked:
                    model_checked = check_served_model(client, settings, planner.profile)
                try:
                    snapshot: RouterSnapshot | None = read()
                except MetricsUnreadable as exc:
                    logger.warning("planner: holding, no figures this interval: %s", exc)
                    snapshot = None
                step = planner.step(snapshot)
                publish(metrics, step)
                print(json.dumps(step_record(step), sort_keys=True), file=out, flush=True)
                if stop.wait(settings.interval_s):
                    return 0
    finally:
        server.shutdown()
        server.server_close()


def publish_desired(metrics: PlannerMetrics, planner: Planner) -> None:
    metrics.desired_replicas.labels(pool="prefill").set(planner.prefill.desired)
    metrics.desired_replicas.labels(pool="decode").set(planner.decode.desired)


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)
    return stop
