"""``pdserve router --workers N`` (and ``pdserve up --router-workers N``) through real
processes: the workers share one port, spread requests over the engines, export their metrics
on their own ports (the per-worker counts add up to the requests sent), and Ctrl-C stops every
worker."""

from __future__ import annotations

import collections
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.up_system import UpSystem, no_processes_left, start_router

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REQUESTS = 120
START_TIMEOUT_S = 120.0


@pytest.fixture(scope="module")
def system(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpSystem]:
    up = UpSystem(
        tmp_path_factory.mktemp("up-workers"),
        "--engine", "stub", "--prefill-replicas", "2", "--decode-replicas", "2",
        "--router-workers", "2",
        env={"PDSERVE_ROUTER_POLICY": "least_loaded"},
    )  # fmt: skip
    try:
        yield up.wait_ready()
    finally:
        pids = [worker["pid"] for worker in up.endpoints.get("router_workers", [])]
        status = up.stop()
        assert status == 0, up.output()
        assert len(pids) == 2
        assert no_processes_left(pids) == []


def send(url: str, count: int) -> list[httpx.Response]:
    """``count`` completions, eight at a time, each on a new connection (so the kernel spreads
    them over the workers)."""

    def one(index: int) -> httpx.Response:
        body = {"model": "stub", "prompt": f"request {index}", "max_tokens": 3}
        headers = {"connection": "close"}
        return httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, range(count)))


def requests_ok(metrics_url: str) -> float:
    text = httpx.get(metrics_url, timeout=10).text
    prefix = 'pdserve_router_requests_total{endpoint="/v1/completions",outcome="ok"} '
    values = [float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)]
    return sum(values)


def test_workers_spread_requests_over_engines_and_their_metrics_add_up(system: UpSystem) -> None:
    workers = system.endpoints["router_workers"]
    assert len(workers) == 2
    metrics = system.endpoints["metrics"]
    assert "router" not in metrics
    assert {metrics["router-0"], metrics["router-1"]} == {w["metrics"] for w in workers}
    before = [requests_ok(worker["metrics"]) for worker in workers]
    responses = send(system.url, REQUESTS)
    assert [r.status_code for r in responses] == [200] * REQUESTS
    # Both workers served, and their own counts add up to what was sent.
    served = [requests_ok(worker["metrics"]) - b for worker, b in zip(workers, before, strict=True)]
    assert all(count > 0 for count in served), served
    assert sum(served) == REQUESTS
    # No engine gets the lion's share: each of two engines per role gets at least a quarter.
    for header in ("x-pdserve-prefill-engine", "x-pdserve-decode-engine"):
        counts = collections.Counter(r.headers[header] for r in responses)
        assert len(counts) == 2, counts
        assert min(counts.values()) >= REQUESTS // 4, (header, counts)


def test_ctrl_c_stops_every_worker_of_pdserve_router(system: UpSystem) -> None:
    """A second ``pdserve router --workers 2`` on the same control plane: it serves, and
    SIGINT to it (what a terminal's Ctrl-C sends) stops both workers and exits 0."""
    checkpoint = system.work_dir / "stub-checkpoint"  # what pdserve up's router reads
    router, announced = start_router(
        system,
        *("--workers", "2", "--tokenizer", str(checkpoint), "--served-model-name", "stub"),
        env={"PDSERVE_ROUTER_POLICY": "least_loaded"},
    )
    try:
        pids = announced["pids"]
        assert len(pids) == 2 and len(announced["metrics_urls"]) == 2
        ok = 0
        for _ in range(100):  # until the workers synced with the control plane
            if httpx.get(f"{announced['url']}/health", timeout=10).status_code == 200:
                ok += 1
            if ok >= 4:
                break
            time.sleep(0.2)
        responses = send(announced["url"], 16)
        assert [r.status_code for r in responses] == [200] * 16
        router.send_signal(signal.SIGINT)
        assert router.wait(timeout=60) == 0
        assert no_processes_left(pids) == []
    finally:
        if router.poll() is None:
            router.kill()
            router.wait()
        if router.stdout is not None:
            router.stdout.close()
