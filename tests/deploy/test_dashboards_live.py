"""Every series a dashboard charts is exported by a running stack, not only documented.

Starts ``pdserve up --work-dir <tmp>`` as a person would and waits for
``<work-dir>/endpoints.json``, the contract of ``pdserve up``: ``{"router": "http://host:port",
"metrics": ["http://host:port/metrics", ...]}``, one metrics URL per process (router and every
engine service; a mapping of process name to URL is read the same way). Then it sends a few
requests through the router, scrapes every ``/metrics`` URL and checks that each series named by
a dashboard query is declared by some process. A histogram counts through its
``_bucket``/``_sum``/``_count`` series; a labelled counter counts once its family is declared,
even before its first sample (a failure counter exists before the first failure).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.devtools.dashboards import dashboard_queries, exported_series, series_in_query
from tests.deploy.chart import DASHBOARDS

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


def log_tail(log: Path, lines: int = 60) -> str:
    text = log.read_text(errors="replace") if log.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


def wait_for_endpoints(work_dir: Path, process: subprocess.Popen[bytes], log: Path) -> Any:
    path = work_dir / "endpoints.json"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"pdserve up exited with {process.returncode}:\n{log_tail(log)}")
        if path.exists():
            try:
                return json.loads(path.read_text())
            except json.JSONDecodeError:
                pass  # being written; read again
        if time.monotonic() > deadline:
            pytest.fail(
                f"pdserve up wrote no {path.name} within {START_TIMEOUT_S:.0f}s (the contract: "
                f'{{"router": URL, "metrics": [URL, ...]}}):\n{log_tail(log)}'
            )
        time.sleep(0.2)


def wait_until_ready(
    client: httpx.Client, router: str, process: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            pytest.fail(f"pdserve up exited with {process.returncode}:\n{log_tail(log)}")
        try:
            if client.get(f"{router}/health").status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"the router never turned healthy:\n{log_tail(log)}")
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
    log = tmp_path / "up.log"
    # A clean environment: no PDSERVE_* setting of the developer's points the stack elsewhere.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env["PYTHONUNBUFFERED"] = "1"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli.main", "up", "--work-dir", str(tmp_path)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        endpoints = wait_for_endpoints(tmp_path, process, log)
        router, metrics = endpoints["router"], endpoints["metrics"]
        # The documented contract is a list; a mapping process name -> URL is read the same way.
        metrics_urls = list(metrics.values()) if isinstance(metrics, dict) else list(metrics)
        assert isinstance(router, str) and router.startswith("http")
        assert len(metrics_urls) >= 3, f"router and at least one engine per role: {metrics_urls}"
        with httpx.Client(timeout=REQUEST_TIMEOUT_S) as client:
            wait_until_ready(client, router, process, log)
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
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
