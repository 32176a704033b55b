"""``pdserve up``: the whole system on one machine, with a live readiness display.

Starts, as subprocesses of this command: the embedded Redis (unless ``--redis`` names one),
``--prefill-replicas`` prefill engines and ``--decode-replicas`` decode engines (``pdserve
prefill`` / ``pdserve decode`` with the chosen PP x TP) and, beside them, the router (``pdserve
router``). ``--colocated`` starts decode engines only and a router that runs every request on
one engine (no disaggregation), to compare against. Without ``--model`` the tiny test checkpoint is
generated into ``<work-dir>/tiny-model`` (no downloads), except for the engines that load no
model (``--engine stub``; ``--engine sim``, whose ``--sim-profile`` goes to every engine): for
them the router's front end reads a synthetic checkpoint of the model they register (their
vocabulary and context, no weights) written into ``<work-dir>/<model>-checkpoint``.

While it runs: every engine's per-rank readiness grid is printed as it changes; each child's
output goes to ``<work-dir>/logs/<name>.log``. Once the router's ``/health`` answers 200,
``<work-dir>/endpoints.json`` names the router URL and every ``/metrics`` URL, and the URL and
an example ``curl`` are printed. ``--prometheus`` also starts a local Prometheus (a ``prometheus``
on ``PATH`` or in the virtual environment; without one it exits before starting anything) that
scrapes every ``/metrics`` URL of ``endpoints.json`` and loads the chart's recording and alert
rules; its URL is printed and written to ``endpoints.json`` (``"prometheus"``).

Ctrl-C (or SIGTERM): the router, then decode engines, then prefill engines get SIGTERM and are
waited for (bounded by ``--stop-timeout-s``); whatever is left of a child's process group
(rank processes included) is then killed, and the embedded Redis stopped. An engine that exits
on its own is reported with the tail of its log and restarted after a back-off (unless
``--no-restart``; a crash loop ends its restarts with an error: :mod:`services.cli.up_supervise`);
the router exiting stops everything with exit status 1. ``--autoscale`` also runs ``pdserve
planner`` over the router and starts or drains engines to its pool sizes
(:mod:`services.cli.up_autoscale`). The children are
:class:`~services.supervision.ChildProcess` objects, built by :mod:`services.cli.up_children`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from services.cli.settings import ToolSettings
from services.cli.status import describe, render_table
from services.cli.up_autoscale import autoscale
from services.cli.up_children import (
    engine_child,
    engine_children,
    model_dir,
    planner_child,
    router_child,
)
from services.cli.up_models import up_models
from services.cli.up_supervise import KeptEngines, supervise
from services.config import ControlPlaneSettings
from services.config.control_plane import split_url_password
from services.control_plane import RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.lifetime import PortTaken, check_free
from services.observability.local_prometheus import RULES_FILE, LocalPrometheus, PrometheusError
from services.supervision import ChildProcess, RestartPolicy, RestartTracker, stop_in_order

PASSWORD_ENV = "PDSERVE_CONTROL_PLANE__REDIS__PASSWORD"
_STOP_ORDER = ("planner", "router", "decode", "prefill")


class StartupFailed(Exception):
    """A child died or did not become ready in time."""


def run(args: argparse.Namespace, settings: ToolSettings) -> int:
    try:
        policy = restart_policy(args)
        up_models(args, None)  # each --model's options, checked before anything starts
    except ValueError as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 2
    if args.autoscale and args.colocated:
        print("pdserve up: --autoscale sizes prefill and decode pools: not with --colocated",
              file=sys.stderr, flush=True)  # fmt: skip
        return 2
    try:
        check_free(fixed_ports(args))
    except PortTaken as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 2
    args.work_dir.mkdir(parents=True, exist_ok=True)
    prometheus: LocalPrometheus | None = None
    if args.prometheus:
        try:
            prometheus = LocalPrometheus(
                args.work_dir / "prometheus",
                scrape_interval_s=args.prometheus_scrape_interval_s,
                rule_files=[RULES_FILE],
            )
        except PrometheusError as exc:
            print(f"pdserve up: --prometheus: {exc}", file=sys.stderr, flush=True)
            return 2
    redis_server: LocalRedisServer | None = None
    control_plane = settings.control_plane
    if args.redis is None:
        redis_server = LocalRedisServer(port=args.redis_port).start()
        control_plane = control_plane.model_copy(
            update={"redis": control_plane.redis.model_copy(update={"url": redis_server.url})}
        )
    url = control_plane.redis.display_url  # never print a password given in the URL
    (args.work_dir / "redis.url").write_text(url + "\n")
    print(f"pdserve up: control plane Redis at {url} (namespace {control_plane.namespace!r})")
    print(f"  inspect it with:  pdserve status --redis {url}")
    print("  Ctrl-C stops everything this command started.", flush=True)
    try:
        return asyncio.run(_up(args, control_plane, prometheus, policy))
    finally:
        if prometheus is not None:
            prometheus.stop()
        if redis_server is not None:
            redis_server.stop()
            print("pdserve up: stopped the embedded Redis", flush=True)


def fixed_ports(args: argparse.Namespace) -> list[tuple[str, str, int]]:
    """The ports this run binds that the user fixed: ``(what, host, port)``, port 0 for "a
    free one". Checked before anything starts."""
    ports: list[tuple[str, str, int]] = []
    if not args.no_engines:
        ports.append(("router", args.host, args.port))
    if args.redis is None and args.redis_port is not None:
        ports.append(("embedded Redis", "127.0.0.1", args.redis_port))
    base = _flag_value(args.router_arg, "--worker-metrics-port")
    if not args.no_engines and base is not None and base.isdigit() and int(base):
        ports += [
            (f"router worker {index}'s metrics", args.host, int(base) + index)
            for index in range(args.router_workers)
        ]
    return ports


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The value of ``flag`` (``--flag V`` or ``--flag=V``) in ``argv``, the last one wins."""
    value = None
    for index, arg in enumerate(argv):
        if arg.startswith(f"{flag}="):
            value = arg.split("=", 1)[1]
        elif arg == flag and index + 1 < len(argv):
            value = argv[index + 1]
    return value


def restart_policy(args: argparse.Namespace) -> RestartPolicy:
    """The engines' restart policy of the command line; ``ValueError`` for bad values."""
    return RestartPolicy(
        enabled=args.restart,
        max_fast_failures=args.restart_limit,
        stable_after_s=args.restart_stable_s,
        backoff_s=args.restart_backoff_s,
        max_backoff_s=args.restart_max_backoff_s,
    )


async def _up(
    args: argparse.Namespace,
    control_plane: ControlPlaneSettings,
    prometheus: LocalPrometheus | None,
    policy: RestartPolicy,
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if args.exit_after is not None:
        loop.call_later(args.exit_after, stop.set)
    display = asyncio.create_task(_display(control_plane, stop))
    children: list[ChildProcess] = []
    status = 0
    try:
        if not args.no_engines:
            status = await _run_system(args, control_plane, children, stop, prometheus, policy)
        else:
            await stop.wait()
    finally:
        await _stop_children(children, args.stop_timeout_s)
        stop.set()
        display.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await display
    return status


async def _run_system(
    args: argparse.Namespace,
    control_plane: ControlPlaneSettings,
    children: list[ChildProcess],
    stop: asyncio.Event,
    prometheus: LocalPrometheus | None,
    policy: RestartPolicy,
) -> int:
    models = up_models(args, model_dir(args))
    # A password given in the URL travels in the children's environment, not their argv.
    redis_url, password = split_url_password(control_plane.redis.url)
    secrets = {} if password is None else {PASSWORD_ENV: password}
    common = ["--redis", redis_url, "--namespace", control_plane.namespace]
    logs = args.work_dir / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engines = engine_children(args, models, common, logs, secrets)
    children.extend(engines)
    deadline = time.monotonic() + args.ready_timeout_s
    # The router starts beside the engines, not once they are READY: its start is mostly
    # importing vLLM's front end, which then overlaps the engines' own start; it follows the
    # control plane and answers /health once it sees them READY (the wait below).
    router = router_child(args, models, common, logs, secrets)
    children.append(router)
    try:
        for child in engines:
            await child.start()
        await router.start()
        await _wait_ready([*engines, router], stop, deadline)
        if stop.is_set():
            return 0
        router_url = str((router.announced or {})["url"])
        await _wait_healthy(router_url, children, stop, deadline)
        if stop.is_set():
            return 0
        planner: ChildProcess | None = None
        if args.autoscale:
            planner = planner_child(args, router_url, logs)
            children.append(planner)
            await planner.start()
            await _wait_ready([planner], stop, deadline)
            if stop.is_set():
                return 0
        endpoints = _endpoints(control_plane, children, router_url)
        if prometheus is not None:
            endpoints["prometheus"] = await _start_prometheus(prometheus, endpoints)
    except StartupFailed as exc:
        print(f"pdserve up: {exc}", file=sys.stderr, flush=True)
        return 1
    _write_endpoints(args.work_dir, endpoints)
    _print_welcome(router_url, await _served_models(router_url), endpoints, args.work_dir)

    def rewrite(trackers: dict[str, RestartTracker]) -> None:
        """After an engine's restart: its new addresses (and Prometheus's targets)."""
        current = _endpoints(control_plane, children, router_url, trackers)
        if prometheus is not None:
            current["prometheus"] = prometheus.url
            prometheus.write_targets(current)
        _write_endpoints(args.work_dir, current)

    async def follow_planner(kept: KeptEngines) -> None:
        assert planner is not None
        await autoscale(
            kept,
            planner=planner,
            children=children,
            new_engine=lambda role, index: engine_child(
                args, models[0], common, logs, secrets, role, index
            ),
            poll_s=args.autoscale_poll_s,
            scale_down_timeout_s=args.scale_down_timeout_s,
        )

    return await supervise(
        engines,
        router,
        stop,
        policy=policy,
        ready_timeout_s=args.ready_timeout_s,
        on_change=rewrite,
        alongside=follow_planner if planner is not None else None,
    )


async def _start_prometheus(prometheus: LocalPrometheus, endpoints: dict[str, Any]) -> str:
    try:
        prometheus.write_targets(endpoints)
        prometheus.launch()  # from the loop's (main) thread: it ends with pdserve up
        await asyncio.to_thread(prometheus.wait_ready)
    except PrometheusError as exc:
        raise StartupFailed(f"Prometheus: {exc}") from exc
    print(f"pdserve up: Prometheus at {prometheus.url} (logs: {prometheus.log_path})", flush=True)
    return prometheus.url


async def _wait_ready(children: list[ChildProcess], stop: asyncio.Event, deadline: float) -> None:
    """Until every child announced itself; :class:`StartupFailed` if one exits or time runs
    out. Returns early when ``stop`` is set."""
    while True:
        waiting = [child.name for child in children if child.announced is None]
        if not waiting:
            return
        message = f"not ready in time: {', '.join(waiting)} (see their logs)"
        if not await _still_starting(children, stop, deadline, message):
            return


async def _wait_healthy(
    url: str, children: list[ChildProcess], stop: asyncio.Event, deadline: float
) -> None:
    async with httpx.AsyncClient(timeout=2.0) as client:
        while not stop.is_set():
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(f"{url}/health")).status_code == 200:
                    return
            message = f"the router at {url} did not report healthy in time"
            await _still_starting(children, stop, deadline, message)


async def _still_starting(
    children: list[ChildProcess], stop: asyncio.Event, deadline: float, late: str
) -> bool:
    """One pause of a start-up wait: :class:`StartupFailed` when a child exited or the
    deadline passed (``late`` says what was late); ``False`` at once when ``stop`` is set."""
    for child in children:
        if child.returncode is not None:
            raise StartupFailed(child.describe_exit())
    if stop.is_set():
        return False
    if time.monotonic() > deadline:
        raise StartupFailed(late)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), 0.1)
    return True


def _endpoints(
    control_plane: ControlPlaneSettings,
    children: list[ChildProcess],
    router_url: str,
    trackers: dict[str, RestartTracker] | None = None,
) -> dict[str, Any]:
    """What ``endpoints.json`` says: the router, every ``/metrics``, every engine (with its
    ``restarts`` and, once given up on, ``"crash_loop": true``)."""
    metrics = {"router": f"{router_url}/metrics"}
    engines: dict[str, dict[str, Any]] = {}
    workers: list[dict[str, Any]] = []
    for child in children:
        announced = child.announced or {}
        if child.role == "planner":
            if announced.get("metrics"):
                metrics["planner"] = str(announced["metrics"])
            continue
        if child.role == "router":
            # Several workers: each one's own /metrics (the shared port answers one of them).
            urls = announced.get("metrics_urls") or []
            pids = announced.get("pids") or []
            if len(urls) > 1:
                del metrics["router"]
                for index, url in enumerate(urls):
                    metrics[f"router-{index}"] = str(url)
                workers = [
                    {"pid": pid, "metrics": url} for pid, url in zip(pids, urls, strict=False)
                ]
            continue
        if announced.get("metrics"):
            metrics[child.name] = str(announced["metrics"])
        tracker = (trackers or {}).get(child.name)
        engines[child.name] = {
            "role": child.role,
            "pid": child.pid if child.running else None,
            "grpc": announced.get("grpc"),
            "metrics": announced.get("metrics"),
            "generation": announced.get("generation"),
            "restarts": tracker.restarts if tracker is not None else 0,
            **({"crash_loop": True} if tracker is not None and tracker.gave_up else {}),
        }
    return {
        "router": router_url,
        "redis": control_plane.redis.display_url,
        "namespace": control_plane.namespace,
        "metrics": metrics,
        "engines": engines,
        **({"router_workers": workers} if workers else {}),
    }


def _write_endpoints(work_dir: Path, endpoints: dict[str, Any]) -> None:
    path = work_dir / "endpoints.json"
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(endpoints, indent=2) + "\n")
    temporary.replace(path)


async def _served_models(router_url: str) -> list[str]:
    """The base models the router lists (``/v1/models`` cards without a parent)."""
    async with httpx.AsyncClient(timeout=5.0) as client:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
            response = await client.get(f"{router_url}/v1/models")
            cards = response.json()["data"]
            return [str(card["id"]) for card in cards if not card.get("parent")]
    return []


def _print_welcome(
    router_url: str, models: list[str], endpoints: dict[str, Any], work_dir: Path
) -> None:
    model = models[0] if models else "MODEL"
    request = json.dumps({"model": model, "prompt": "Hello, world!", "max_tokens": 16})
    print(f"\npdserve up: ready. OpenAI-compatible endpoint: {router_url}/v1", flush=True)
    named = ", ".join(repr(name) for name in models) or repr(model)
    plural = "s" if len(models) > 1 else ""
    print(f"  model{plural} {named} on {len(endpoints['engines'])} engine(s)")
    print(f"  endpoints (router, every /metrics): {work_dir / 'endpoints.json'}")
    if "prometheus" in endpoints:
        print(f"  Prometheus (every /metrics, alert rules loaded): {endpoints['prometheus']}")
    print(
        f"  try:  curl -s {router_url}/v1/completions "
        f"-H 'Content-Type: application/json' -d '{request}'",
        flush=True,
    )


async def _stop_children(children: list[ChildProcess], timeout_s: float) -> None:
    """SIGTERM in order (router, decode, prefill), wait, then kill what is left of each
    child's process group."""

    def late(child: ChildProcess) -> None:
        print(f"pdserve up: {child.name} did not stop in {timeout_s}s; killing it")

    groups = [[c for c in children if c.role == role] for role in _STOP_ORDER]
    await stop_in_order(groups, timeout_s, on_late=late)
    if children:
        print("pdserve up: stopped " + ", ".join(c.name for c in children), flush=True)


async def _display(settings: ControlPlaneSettings, stop: asyncio.Event) -> None:
    control_plane = RedisControlPlane(settings)
    try:
        async with control_plane.watch(handshake_progress=True) as watcher:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    change = await watcher.next_change(0.5)
                    inspection = await control_plane.inspect(change.engine_id)
                    if inspection is None:
                        print(f"engine {change.engine_id} gone", flush=True)
                    else:
                        print(render_table([describe(inspection)], settings.namespace), flush=True)
    finally:
        await control_plane.close()
