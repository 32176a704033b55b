"""Several routers read as one: increases per router added up (a new router's past, a restarted
router's drop and a departed router never move the total backwards or in one jump), ready engines
the largest any router reports; and, with real HTTP servers on two loopback addresses behind one
port, ``pdserve planner``'s reader in ``dns`` mode reading both."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from services.control_plane.local_redis import free_port
from services.planner.config import PlannerSettings
from services.planner.errors import MetricsUnreadable
from services.planner.fleet import RouterFleet, read_fleet, resolve_addresses
from services.planner.main import router_reader
from services.planner.observe import EngineReport, RouterSnapshot, interval_between


def snap(
    requests: float, ttft: tuple[float, float] = (0.0, 0.0), ready: int | None = None
) -> RouterSnapshot:
    """A router's cumulative figures: ``requests``, TTFT (sum s, count), ready engines."""
    return RouterSnapshot(
        at_s=0.0,
        requests=requests,
        ttft_sum_s=ttft[0],
        ttft_count=ttft[1],
        itl_sum_s=0.0,
        itl_count=0.0,
        ready_prefill=ready,
        ready_decode=ready,
    )


def test_routers_add_up_by_their_increases() -> None:
    fleet = RouterFleet()
    first = fleet.add({"10.0.0.1": snap(100, (5.0, 100)), "10.0.0.2": snap(40, (2.0, 40))}, 0.0)
    assert first.requests == 0  # the baseline: neither router's past counts
    second = fleet.add({"10.0.0.1": snap(130, (6.5, 130)), "10.0.0.2": snap(50, (2.5, 50))}, 10.0)
    interval = interval_between(first, second)
    assert interval is not None
    assert interval.rate_rps == pytest.approx(4.0)  # (30 + 10) requests over 10 s
    assert interval.ttft_ms == pytest.approx(50.0)  # (1.5 + 0.5) s over 40


def test_token_figures_add_up_only_when_every_router_has_them() -> None:
    def tokens(requests: float, prompt: float, generated: float) -> RouterSnapshot:
        plain = snap(requests)
        return RouterSnapshot(
            **{
                **plain.__dict__,
                "prompt_tokens": (prompt, requests),
                "generation_tokens": (generated, requests),
            }
        )

    fleet = RouterFleet()
    first = fleet.add({"a": tokens(10, 1000, 100), "b": tokens(4, 400, 40)}, 0.0)
    second = fleet.add({"a": tokens(20, 3000, 200), "b": tokens(14, 1400, 340)}, 10.0)
    interval = interval_between(first, second)
    assert interval is not None
    # (2000 + 1000) prompt tokens and (100 + 300) generated over 20 requests.
    assert interval.input_tokens == pytest.approx(150.0)
    assert interval.output_tokens == pytest.approx(20.0)
    # A router that counts no tokens: the fleet reports none rather than a skewed mean.
    mixed = fleet.add({"a": tokens(30, 4000, 300), "b": snap(20)}, 20.0)
    assert mixed.prompt_tokens is None and mixed.generation_tokens is None


def test_a_new_a_restarted_and_a_departed_router_never_jump_or_go_back() -> None:
    fleet = RouterFleet()
    fleet.add({"a": snap(100), "b": snap(100)}, 0.0)
    before = fleet.add({"a": snap(110), "b": snap(120)}, 10.0)
    assert before.requests == 30
    # "c" appears with a long past, "b" restarted (counted 5 since), "a" left.
    after = fleet.add({"b": snap(5), "c": snap(10_000)}, 20.0)
    assert after.requests == 35  # only b's 5 since its restart
    interval = interval_between(before, after)
    assert interval is not None and interval.rate_rps == pytest.approx(0.5)
    later = fleet.add({"b": snap(15), "c": snap(10_020)}, 30.0)
    assert later.requests == 35 + 10 + 20


def test_ready_engines_are_the_largest_any_router_reports() -> None:
    fleet = RouterFleet()
    snapshot = fleet.add({"a": snap(0, ready=2), "b": snap(0, ready=3), "c": snap(0)}, 0.0)
    assert (snapshot.ready_prefill, snapshot.ready_decode) == (3, 3)
    assert fleet.add({"c": snap(0)}, 1.0).ready_prefill is None


def test_a_round_with_no_router_read_is_unreadable_and_a_partial_one_says_who() -> None:
    def read(url: str) -> RouterSnapshot:
        if "10.0.0.2" in url:
            raise MetricsUnreadable("connection refused")
        return snap(1)

    fleet = RouterFleet()
    snapshot, failures = read_fleet(
        fleet, "http", "router", [8000], read, lambda: 0.0, lambda h, p: ["10.0.0.1", "10.0.0.2"]
    )
    assert snapshot.requests == 0
    assert failures == {"10.0.0.2:8000": "connection refused"}
    urls: list[str] = []

    def refuse(url: str) -> RouterSnapshot:
        urls.append(url)
        raise MetricsUnreadable("down")

    with pytest.raises(MetricsUnreadable, match="no router behind 'router'"):
        read_fleet(fleet, "http", "router", [8000], refuse, lambda: 0.0, lambda h, p: ["fd00::7"])
    assert urls == ["http://[fd00::7]:8000/metrics"]


def test_a_name_that_does_not_resolve_is_unreadable() -> None:
    with pytest.raises(MetricsUnreadable, match="does not resolve"):
        resolve_addresses("no-such-router.invalid", 8000)
    assert "127.0.0.1" in resolve_addresses("127.0.0.1", 8000)


def _router_text(requests: int, ready: int) -> str:
    return (
        "# TYPE pdserve_router_requests_total counter\n"
        f'pdserve_router_requests_total{{endpoint="completions",outcome="ok"}} {requests}\n'
        "# TYPE pdserve_router_ready_engines gauge\n"
        f'pdserve_router_ready_engines{{role="prefill"}} {ready}\n'
        f'pdserve_router_ready_engines{{role="decode"}} {ready}\n'
    )


@contextmanager
def routers(counts: dict[tuple[str, int], list[int]]) -> Iterator[None]:
    """Real HTTP servers, one per (address, port), each serving router figures whose request
    count is the next of ``counts[(address, port)]`` at each read (the last one repeated)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            address, port = self.server.server_address[:2]
            series = counts[(str(address), int(port))]
            value = series.pop(0) if len(series) > 1 else series[0]
            body = _router_text(value, ready=2).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    servers = [ThreadingHTTPServer(endpoint, Handler) for endpoint in counts]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def test_the_dns_reader_reads_every_router_behind_the_name() -> None:
    """Two router pods (two loopback addresses, one port) behind one name."""
    port = free_port()
    settings = PlannerSettings(
        router_url=f"http://routers.test:{port}", router_discovery="dns", metrics_port=0
    )
    asked: list[tuple[str, int]] = []

    def resolve(host: str, resolved_port: int) -> list[str]:
        asked.append((host, resolved_port))
        return ["127.0.0.1", "127.0.0.2"]

    counts = {("127.0.0.1", port): [100, 130], ("127.0.0.2", port): [7, 17]}
    with routers(counts), httpx.Client(timeout=10) as client:
        read = router_reader(settings, client, resolve)
        first, second = read(), read()
    assert asked == [("routers.test", port)] * 2
    assert first.requests == 0
    assert second.requests == (130 - 100) + (17 - 7)
    assert second.ready_decode == 2


def test_the_dns_reader_reads_each_worker_port_of_a_router_pod() -> None:
    """One router pod with two worker processes, each with its own metrics port."""
    ports = [free_port(), free_port()]
    settings = PlannerSettings(
        router_url="http://routers.test:8000",
        router_discovery="dns",
        router_metrics_ports=ports,
        metrics_port=0,
    )
    counts = {("127.0.0.1", ports[0]): [5, 25], ("127.0.0.1", ports[1]): [50, 53]}
    with routers(counts), httpx.Client(timeout=10) as client:
        read = router_reader(settings, client, lambda host, port: ["127.0.0.1"])
        first, second = read(), read()
    assert (first.requests, second.requests) == (0, 20 + 3)


def test_worker_ports_need_dns_discovery() -> None:
    with pytest.raises(ValueError, match="router_metrics_ports needs router_discovery='dns'"):
        PlannerSettings(router_metrics_ports=[9300])


def test_an_engine_relayed_by_two_routers_counts_once() -> None:
    def relaying(requests: float, *reports: EngineReport) -> RouterSnapshot:
        return replace(snap(requests, ready=2), engine_loads=reports)

    d0 = EngineReport("decode-0", "decode", 1, 30, 100, 1000)
    d1 = EngineReport("decode-1", "decode", 0, 20, 300, 1000)
    p0 = EngineReport("prefill-0", "prefill", 4, 1, 800, 1000)
    # Router b read decode-0 one heartbeat later: one more queued, fewer blocks free.
    d0_later = EngineReport("decode-0", "decode", 2, 30, 60, 1000)
    fleet = RouterFleet()
    fleet.add({"a": relaying(0, d0, d1, p0), "b": relaying(0, d0_later, d1, p0)}, 0.0)
    merged = fleet.add({"a": relaying(5, d0, d1, p0), "b": relaying(5, d0_later, d1, p0)}, 1.0)
    assert merged.engine_loads is not None and len(merged.engine_loads) == 3
    decode = merged.pool_load("decode")
    prefill = merged.pool_load("prefill")
    assert decode is not None and prefill is not None
    assert (decode.engines, decode.queue_depth, decode.running_requests) == (2, 2, 50)
    assert (decode.kv_blocks_free, decode.kv_blocks_total) == (360, 2000)  # not 4000
    assert (prefill.engines, prefill.queue_depth) == (1, 4)  # not 8


def test_engine_loads_are_none_only_when_no_router_relays_them() -> None:
    d0 = EngineReport("decode-0", "decode", 0, 1, 10, 100)
    fleet = RouterFleet()
    assert fleet.add({"a": snap(0), "b": snap(0)}, 0.0).engine_loads is None
    mixed = fleet.add({"a": snap(1), "b": replace(snap(1), engine_loads=(d0,))}, 1.0)
    assert mixed.engine_loads == (d0,)
