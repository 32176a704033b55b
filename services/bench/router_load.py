"""The measuring of ``pdserve bench router`` (:mod:`services.bench.router`), for either system.

A :class:`Target` is a URL and the processes whose CPU is charged to it. :func:`measure` runs
the windows the benchmark reports for one router: the baseline (the same client against the
instant server) and the same through the router one at a time (``added_latency_ms``), the load
levels (``load``, ``max_sustained_rps``), the streamed windows (``streamed``) and, for a router
that serves chat, a chat window (``chat``). Each window is a closed loop of
:mod:`services.bench.loadgen` processes, with the CPU of the router, the stubs and the load
processes read from ``/proc`` over it. :func:`start_instant` and
:func:`load_generator_figures` give the instant server and the load generator's own ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.bench.procs import START_TIMEOUT_S, cpu_seconds, descendants, start, stop
from services.bench.stats import percentiles
from services.control_plane.local_redis import free_port
from services.supervision import ChildProcess

PROMPT = "Hello, world! The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 4
STREAMED_CONCURRENCY = 8
"""Connections of the streamed-request windows (``streamed``)."""


def request_body(max_tokens: int, stream: bool = False, chat: bool = False) -> str:
    """The JSON body of the bench's completion request (with ``chat``: the chat completion
    of one user message holding the same prompt). ``ignore_eos``: a real model (vLLM's own
    API server's) answers exactly ``max_tokens`` tokens, as the stub engines do."""
    fields: dict[str, Any] = {"model": "stub", "max_tokens": max_tokens, "temperature": 0}
    fields |= {"messages": [{"role": "user", "content": PROMPT}]} if chat else {"prompt": PROMPT}
    fields["ignore_eos"] = True
    return json.dumps({**fields, "stream": True} if stream else fields)


BODY = request_body(MAX_TOKENS)
CHAT_BODY = request_body(MAX_TOKENS, chat=True)
SPAWN_MARGIN_S = 1.0
"""Load processes start this long before their window (Python start-up) and warm up in it."""


@dataclass
class Placement:
    """Which cores the router under test and everything else (stubs, load) run on."""

    router: set[int] | None
    others: set[int] | None

    def describe(self) -> dict[str, Any]:
        if self.router is None:
            return {"pinned": False}
        return {
            "pinned": True,
            "router_cores": sorted(self.router),
            "stubs_and_load_cores": sorted(self.others or ()),
        }


@dataclass
class Target:
    """What one load run measures: the URL, and whose CPU is charged to it."""

    url: str
    router: Sequence[ChildProcess]
    stubs: Sequence[ChildProcess] = ()
    chat_url: str | None = None
    """The chat completions URL, when the router serves chat (``chat`` figures)."""
    router_children: bool = True
    """Whether the router's descendant processes are charged to it (its workers). False for
    vLLM's own API server, whose engine runs in a child (``EngineCore``): the process alone is
    its front end, and the children's CPU is reported as the stubs'."""

    def pids(self) -> tuple[list[int], list[int]]:
        """``(the router's pids, the stubs' pids)``, live now."""
        stubs = [pid for service in self.stubs for pid in descendants(service.pid)]
        if self.router_children:
            return [pid for s in self.router for pid in descendants(s.pid)], stubs
        below = [pid for s in self.router for pid in descendants(s.pid)[1:]]
        return [s.pid for s in self.router], stubs + below


def _percentiles_us(samples: Sequence[int]) -> dict[str, float]:
    p50, p99 = percentiles(samples, (50, 99))
    return {"p50_ms": p50 / 1e3, "p99_ms": p99 / 1e3}


WINDOW_ATTEMPTS = 3
"""Windows of a measurement that completed no request (and failed none), or whose CPU was read
over less than :data:`MIN_CPU_COVERAGE` of it, are run again, each twice as long as the one
before, up to this many in all: a window shorter than one request on a loaded machine gives no
per-request figure."""
MIN_CPU_COVERAGE = 0.5
"""The share of a window that the CPU readings before and after it must span. On a loaded
machine the bench itself may wake late for its first reading, after the load generators
stopped: the router, idle by then, read 0 CPU per request."""


async def _load(
    target: Target,
    connections: int,
    duration_s: float,
    args: argparse.Namespace,
    placement: Placement,
    log_dir: Path,
    body: str = BODY,
    url: str | None = None,
) -> dict[str, Any]:
    """One closed-loop window of ``connections`` connections (see :func:`_window`); one that
    completed no request and failed none, or whose CPU readings missed it, is run again twice
    as long (:data:`WINDOW_ATTEMPTS`), and ``window_s`` says how long the reported one lasted."""
    for attempt in range(WINDOW_ATTEMPTS):
        window_s = duration_s * 2**attempt
        entry = await _window(target, connections, window_s, args, placement, log_dir, body, url)
        entry["window_s"] = window_s
        if (entry["_latencies_us"] or entry["errors"]) and entry["cpu_coverage"] is not None:
            break
    return entry


async def _window(
    target: Target,
    connections: int,
    duration_s: float,
    args: argparse.Namespace,
    placement: Placement,
    log_dir: Path,
    body: str,
    url: str | None,
) -> dict[str, Any]:
    """One closed-loop window of ``connections`` connections over up to ``--load-processes``
    load processes (to ``url``, the target's by default); CPU of the router, the stubs and the
    load processes over the window."""
    processes = max(1, min(args.load_processes, connections))
    shares = [connections // processes + (i < connections % processes) for i in range(processes)]
    start_at = time.time() + SPAWN_MARGIN_S + min(1.0, duration_s / 3)
    stop_at = start_at + duration_s
    generators = [
        await start(
            f"loadgen-{i}",
            [
                sys.executable, "-m", "services.bench.loadgen", "run",
                url or target.url, body, str(share), repr(start_at), repr(stop_at),
            ],
            log_dir,
            cores=placement.others,
            capture_stdout=True,
        )
        for i, share in enumerate(shares)
    ]  # fmt: skip
    outputs = [asyncio.ensure_future(g.communicate()) for g in generators]
    try:
        # Scanning /proc for the pids takes long on a loaded machine: before the window.
        router_pids, stub_pids = target.pids()
        load_pids = [g.pid for g in generators]
        await asyncio.sleep(max(0.0, start_at - time.time()))
        read_before = time.time()
        before = (cpu_seconds(router_pids), cpu_seconds(stub_pids), cpu_seconds(load_pids))
        await asyncio.sleep(max(0.0, stop_at - time.time()))
        after = (cpu_seconds(router_pids), cpu_seconds(stub_pids), cpu_seconds(load_pids))
        read_after = time.time()
        results = [json.loads(stdout) for stdout, _ in await asyncio.gather(*outputs)]
    finally:
        for generator in generators:
            await stop(generator)
    latencies = [sample for result in results for sample in result["latencies_us"]]
    completed = len(latencies)
    errors = sum(result["errors"] for result in results)
    router_s, stub_s, load_s = (b - a for a, b in zip(before, after, strict=True))
    coverage = cpu_coverage(start_at, stop_at, read_before, read_after)
    # No request completed within the window (requests longer than it), or the CPU readings
    # missed it: no per-request figure (null in the JSON, never NaN, never a false 0). The
    # CPU read over part of the window stands for the whole of it.
    per_request = 1e3 / completed / coverage if completed and coverage is not None else None
    return {
        "concurrency": connections,
        "requests_per_s": completed / duration_s,
        "errors": errors,
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        **_percentiles_us(latencies),
        "router_cpu_ms_per_request": _per_request(router_s, per_request),
        "router_cores_used": router_s / duration_s / coverage if coverage is not None else None,
        "stub_cpu_ms_per_request": _per_request(stub_s, per_request),
        "load_generator_cpu_ms_per_request": _per_request(load_s, per_request),
        "load_generator_processes": processes,
        "cpu_coverage": coverage,
        "_latencies_us": latencies,
    }


def cpu_coverage(
    start_at: float, stop_at: float, read_before: float, read_after: float
) -> float | None:
    """The share of the window ``[start_at, stop_at]`` that the CPU readings at
    ``read_before`` and ``read_after`` span, ``None`` below :data:`MIN_CPU_COVERAGE`: the
    figures would count the idle time after the load (or before it) as the window's."""
    spanned = min(read_after, stop_at) - max(read_before, start_at)
    share = spanned / (stop_at - start_at)
    return round(share, 3) if share >= MIN_CPU_COVERAGE else None


def _per_request(cpu_s: float, ms_per_request_second: float | None) -> float | None:
    return cpu_s * ms_per_request_second if ms_per_request_second is not None else None


async def measure(
    target: Target,
    instant: Target,
    args: argparse.Namespace,
    placement: Placement,
    log_dir: Path,
) -> dict[str, Any]:
    """The baseline (the same client, one at a time, against the instant server) right before
    the same through the router, so both see the same machine; then the load levels."""
    direct = await _load(instant, 1, args.latency_s, args, placement, log_dir)
    baseline = direct.pop("_latencies_us")
    (baseline_p50_us,) = percentiles(baseline, (50,))
    one = await _load(target, 1, args.latency_s, args, placement, log_dir)
    routed = one.pop("_latencies_us")
    added = [int(sample - baseline_p50_us) for sample in routed]
    load = []
    for level in args.concurrency.split(","):
        if level.strip():
            entry = await _load(target, int(level), args.duration_s, args, placement, log_dir)
            entry.pop("_latencies_us")
            load.append(entry)
    clean = [entry for entry in load if entry["errors"] == 0]
    best = max(clean, key=lambda entry: entry["requests_per_s"]) if clean else None
    streamed = await _streamed(target, args, placement, log_dir)
    chat = await _chat(target, best or (load[-1] if load else None), args, placement, log_dir)
    return {
        "baseline_latency_ms": _percentiles_us(baseline),
        "router_latency_ms": _percentiles_us(routed),
        "added_latency_ms": _percentiles_us(added),
        "router_cpu_ms_per_request": best["router_cpu_ms_per_request"] if best else None,
        "router_cpu_ms_per_request_sequential": one["router_cpu_ms_per_request"],
        "stub_cpu_ms_per_request": best["stub_cpu_ms_per_request"] if best else None,
        "load": load,
        "max_sustained_rps": best["requests_per_s"] if best else 0.0,
        "best_concurrency": best["concurrency"] if best else None,
        **({"streamed": streamed} if streamed is not None else {}),
        **({"chat": chat} if chat is not None else {}),
    }


async def _chat(
    target: Target,
    level: dict[str, Any] | None,
    args: argparse.Namespace,
    placement: Placement,
    log_dir: Path,
) -> dict[str, Any] | None:
    """Router CPU per non-streamed chat completion (:data:`CHAT_BODY`: the same prompt as one
    user message, through the model's chat template), a window at the concurrency of
    ``level`` (the best completions level), beside that level's completions figure."""
    if target.chat_url is None or level is None:
        return None
    entry = await _load(
        target, level["concurrency"], args.duration_s, args, placement, log_dir,
        CHAT_BODY, target.chat_url,
    )  # fmt: skip
    entry.pop("_latencies_us")
    chat_cpu = entry["router_cpu_ms_per_request"]
    completions_cpu = level["router_cpu_ms_per_request"]
    return {
        "concurrency": entry["concurrency"],
        "router_cpu_ms_per_request": chat_cpu,
        "completions_router_cpu_ms_per_request": completions_cpu,
        "chat_over_completions": chat_cpu / completions_cpu
        if chat_cpu and completions_cpu
        else None,
        "requests_per_s": entry["requests_per_s"],
        "errors": entry["errors"],
        "first_error": entry["first_error"],
        "p50_ms": entry["p50_ms"],
        "p99_ms": entry["p99_ms"],
        "stub_cpu_ms_per_request": entry["stub_cpu_ms_per_request"],
        "load_generator_cpu_ms_per_request": entry["load_generator_cpu_ms_per_request"],
    }


async def _streamed(
    target: Target, args: argparse.Namespace, placement: Placement, log_dir: Path
) -> dict[str, Any] | None:
    """Router CPU per streamed request at two ``max_tokens`` (``--streamed-tokens``), each a
    window of :data:`STREAMED_CONCURRENCY` connections; their difference over the token
    difference is what one more streamed token costs the router."""
    counts = sorted({int(n) for n in str(args.streamed_tokens).split(",") if n.strip()})
    if not counts:
        return None
    if len(counts) != 2:
        raise ValueError(f"--streamed-tokens takes two token counts, got {args.streamed_tokens!r}")
    windows = {}
    for count in counts:
        body = request_body(count, stream=True)
        entry = await _load(
            target, STREAMED_CONCURRENCY, args.duration_s, args, placement, log_dir, body
        )
        entry.pop("_latencies_us")
        windows[str(count)] = entry
    low, high = (windows[str(count)] for count in counts)
    clean = low["errors"] == 0 and high["errors"] == 0
    measured = (low["router_cpu_ms_per_request"], high["router_cpu_ms_per_request"])
    per_token = (
        (measured[1] - measured[0]) / (counts[1] - counts[0])
        if clean and None not in measured
        else None
    )
    return {
        "concurrency": STREAMED_CONCURRENCY,
        "max_tokens": counts,
        "router_cpu_ms_per_request": {
            key: entry["router_cpu_ms_per_request"] for key, entry in windows.items()
        },
        "requests_per_s": {key: entry["requests_per_s"] for key, entry in windows.items()},
        "errors": {key: entry["errors"] for key, entry in windows.items()},
        "first_error": next((e["first_error"] for e in windows.values() if e["first_error"]), None),
        "router_cpu_ms_per_extra_token": per_token,
    }


async def start_instant(placement: Placement, log_dir: Path) -> tuple[ChildProcess, Target]:
    """The instant HTTP server of the baselines and of the load generator's ceiling, on the
    router's core (where a router under test would be)."""
    port = free_port()
    server = await start(
        "instant",
        [sys.executable, "-m", "services.bench.loadgen", "serve", str(port)],
        log_dir,
        cores=placement.router,
    )
    url = f"http://127.0.0.1:{port}/v1/completions"
    await wait_http(url, "POST", {}, service=server)
    return server, Target(url, router=[server])


async def load_generator_figures(
    instant: Target, args: argparse.Namespace, placement: Placement, log_dir: Path
) -> dict[str, Any]:
    """The load generator against the instant server at the highest concurrency: its
    ceiling and its own CPU per request."""
    top = max(int(level) for level in args.concurrency.split(",") if level.strip())
    ceiling = await _load(instant, top, args.duration_s, args, placement, log_dir)
    return {
        "kind": "services.bench.loadgen (raw HTTP/1.1 keep-alive, asyncio)",
        "processes": args.load_processes,
        "ceiling": {
            "concurrency": top,
            "requests_per_s": ceiling["requests_per_s"],
            "errors": ceiling["errors"],
            "cpu_ms_per_request": ceiling["load_generator_cpu_ms_per_request"],
            "instant_server_cpu_ms_per_request": ceiling["router_cpu_ms_per_request"],
        },
    }


async def wait_http(
    url: str,
    method: str = "GET",
    body: Any = None,
    *,
    service: ChildProcess | None = None,
    timeout_s: float = START_TIMEOUT_S,
) -> None:
    """Until ``url`` answers 200 (up to ``timeout_s``); fails at once, with the end of its log,
    if ``service`` exits first."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if service is not None and service.returncode is not None:
                raise RuntimeError(
                    f"{service.name} exited with status {service.returncode} before "
                    f"{url} answered; the end of its stderr ({service.log_path}):\n"
                    f"{service.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                response = await client.request(method, url, json=body)
                if response.status_code == 200:
                    return
            await asyncio.sleep(0.2)
    tail = f"; the end of its stderr:\n{service.log_tail()}" if service is not None else ""
    raise RuntimeError(f"{url} did not answer 200 within {timeout_s}s{tail}")
