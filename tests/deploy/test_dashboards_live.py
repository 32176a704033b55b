"""Every series a dashboard charts is exported by a running stack, not only documented.

Starts ``pdserve up --work-dir <tmp>`` as a person would (tests/e2e/up_system.UpSystem: its own
process group, stopped with Ctrl-C and killed as a group as a last resort) and waits for
``<work-dir>/endpoints.json``, the contract of ``pdserve up``: ``{"router": "http://host:port",
"metrics": {"router": "http://host:port/metrics", <engine>: URL, ...}}``, one metrics URL per
process (router and every engine service). Then it sends a few
requests through the router, scrapes every ``/metrics`` URL and checks that each series named by
a dashboard query is declared by some process. A histogram counts through its
``_bucket``/``_sum``/``_count`` series; a labelled counter counts once its family is declared,
even before its first sample (a failure counter exists before the first failure).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest

from services.devtools.dashboards import dashboard_queries, exported_series, series_in_query
from tests.deploy.chart import DASHBOARDS
from tests.e2e.up_system import UpSystem

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# Engines load the tiny model and every (pp, tp) rank publishes its handshake before READY; on a
# loaded 2-core machine that takes a while. Each wait below is bounded and fails with the log.
START_TIMEOUT_S = 300.0
REQUEST_TIMEOUT_S = 120.0


def charted_series() -> dict[str, set[str]]:
    """Series name -> the dashboards' queries that name it."""
    charted: dict[str, set[str]] = {}
    for path in DASHBOARDS:
        for query in dashboard_queries(json.loads(path.read_text())):
            for name in series_in_query(query.expr):
                charted.setdefault(name, set()).add(f"{query.dashboard}: {query.location}")
    return charted


def wait_until_healthy(client: httpx.Client, up: UpSystem) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if up.process.poll() is not None:
            pytest.fail(f"pdserve up exited with {up.process.returncode}:\n{up.output()}")
        try:
            if client.get(f"{up.url}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the router never turned healthy:\n{up.output()}")
        time.sleep(0.5)


def send_requests(client: httpx.Client, router: str) -> None:
    models = client.get(f"{router}/v1/models")
    assert models.status_code == 200, models.text
    model = models.json()["data"][0]["id"]
    for prompt in ("The capital of France is", "One, two, three,"):
        reply = client.post(
            f"{router}/v1/completions",
            json={"model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0},
        )
        assert reply.status_code == 200, reply.text
    with client.stream(
        "POST",
        f"{router}/v1/chat/completions",
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Count to three."}],
            "max_tokens": 4,
            "stream": True,
        },
    ) as stream:
        assert stream.status_code == 200
        body = "".join(stream.iter_text())
    assert body.rstrip().endswith("data: [DONE]"), body[-200:]


def test_every_dashboard_series_is_exported_by_a_running_stack(tmp_path: Path) -> None:
    # A clean environment: no PDSERVE_* setting of the developer's points the stack elsewhere.
    up = UpSystem(tmp_path, scrub_env=True)
    try:
        endpoints = up.wait_ready(timeout_s=START_TIMEOUT_S).endpoints
        router, metrics = endpoints["router"], endpoints["metrics"]
        assert isinstance(router, str) and router.startswith("http")
        assert isinstance(metrics, dict), f"metrics: process name -> URL, got {metrics!r}"
        metrics_urls = list(metrics.values())
        assert len(metrics_urls) >= 3, f"router and at least one engine per role: {metrics_urls}"
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            wait_until_healthy(client, up)
            send_requests(client, router)
            exported: set[str] = set()
            for url in metrics_urls:
                page = client.get(url)
                assert page.status_code == 200, f"{url}: {page.status_code}"
                exported |= exported_series(page.text)
        missing = {
            f"{name}  <- {sorted(where)[0]}"
            for name, where in charted_series().items()
            if name not in exported
        }
        assert missing == set(), (
            "charted by a dashboard but exported by no process of `pdserve up` "
            f"(scraped {metrics_urls})"
        )
    finally:
        up.stop()
