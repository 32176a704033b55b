"""``pdserve bench router``: the router's own cost, next to vllm-router, in the same run.

Two systems, each a router in front of one instant prefill and one instant decode engine:

- **pdserve**: ``pdserve router`` (subprocess) over the control plane (embedded Redis) and two
  ``pdserve prefill|decode --engine stub`` engines (gRPC, no model: tokens are instant);
- **vllm-router**: ``vllm-router --vllm-pd-disaggregation`` (the Rust router from PyPI, in the
  ``dev`` extra) over two minimal OpenAI-compatible HTTP stubs served by this module
  (:func:`stub_app`), which answer instantly as a vLLM prefill (``max_tokens=1``,
  ``kv_transfer_params`` back) and a vLLM decode would.

Equal stub work: for a non-streamed request each router makes one prefill call answered in one
message and one decode call answered in one message (pdserve's decode is coalesced with
``coalesce_first``); pdserve's decode engine checks the KV handle's producer against its
watcher's cached view (no Redis read per call), as vllm-router's stubs read nothing.

Figures, per system:

- ``router_cpu_ms_per_request``: CPU time (user + system, every thread and child process) of
  the router's processes over a measured window, read from ``/proc``, divided by the requests
  answered in it: the figure that does not depend on who else is on the machine. The stubs'
  CPU per request is reported beside it (``stub_cpu_ms_per_request``) so unequal stub work
  shows;
- ``added_latency_ms``: p50/p99 of requests through the router, one at a time, minus the p50
  of the **same client** calling the same instant HTTP server directly
  (``baseline_latency_ms``, measured right before, so both see the same machine): what a
  client pays for routing over talking to an engine that costs nothing, the router's two
  engine calls and the stubs' answers included;
- ``load``: for each concurrency, a closed loop of that many keep-alive connections for
  ``--duration-s``: requests/s, p50/p99, errors, and the cores the router used;
  ``max_sustained_rps`` is the best rate at a concurrency with no error;
- ``streamed``: router CPU per streamed request at two ``max_tokens`` (``--streamed-tokens``,
  default 4 and 64; the stubs stream one message or event per token for both systems), and
  their difference per token, ``router_cpu_ms_per_extra_token``: what one more streamed token
  costs the router.

The load generator is :mod:`services.bench.loadgen` (raw HTTP/1.1, ``--load-processes``
processes), the same for both systems. Its own ceiling against an instant server and its CPU
per request are measured in the same run (``load_generator``). With four or more cores (or
``--pin yes``) the router under test runs pinned to the first core and the stubs and load
generator to the others (``machine.pinning``), so the router never competes with its own load;
the machine's load average before and after says what else ran.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from services.bench.procs import (
    START_TIMEOUT_S,
    core_split,
    cpu_seconds,
    descendants,
    load_average,
    start,
    stop,
)
from services.bench.stats import percentiles
from services.config import ControlPlaneSettings
from services.control_plane.local_redis import LocalRedisServer, free_port
from services.serving.ready import pdserve_argv
from services.supervision import ChildProcess

PROMPT = "Hello, world! The quick brown fox jumps over the lazy dog."
MAX_TOKENS = 4
VLLM_ROUTER_REQUIREMENT = "vllm-router==0.1.17"
STREAMED_CONCURRENCY = 8
"""Connections of the streamed-request windows (``streamed``)."""


def request_body(max_tokens: int, stream: bool = False) -> str:
    """The JSON body of the bench's completion request."""
    fields = {"model": "stub", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return json.dumps({**fields, "stream": True} if stream else fields)


BODY = request_body(MAX_TOKENS)
SPAWN_MARGIN_S = 1.0
"""Load processes start this long before their window (Python start-up) and warm up in it."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--concurrency", default="1,8,32", help="comma-separated client counts (default 1,8,32)"
    )
    parser.add_argument(
        "--duration-s", type=float, default=3.0, help="measured seconds per concurrency"
    )
    parser.add_argument(
        "--latency-s", type=float, default=3.0, help="seconds of one-at-a-time requests"
    )
    parser.add_argument(
        "--load-processes",
        type=int,
        default=2,
        help="load generator processes (each runs its share of the connections)",
    )
    parser.add_argument(
        "--pin",
        choices=("auto", "yes", "no"),
        default="auto",
        help="pin the router to one core and its stubs and load to the others (auto: with 4 "
        "or more cores)",
    )
    parser.add_argument(
        "--streamed-tokens",
        default="4,64",
        help="two max_tokens of streamed requests whose router CPU per request, divided by "
        "their difference, is the cost of one more streamed token (empty: not measured)",
    )
    parser.add_argument(
        "--skip-vllm-router", action="store_true", help="measure pdserve only (no reference)"
    )
    parser.add_argument(
        "--router-workers",
        default="1",
        help="comma-separated pdserve router process counts (pdserve router --workers), each "
        "measured in turn; the first is the one compared with vllm-router (default 1)",
    )


# -- the HTTP stub engines behind vllm-router -----------------------------------------------------


def stub_app(role: str) -> Callable[..., Awaitable[None]]:
    """A raw ASGI app answering like an instant vLLM prefill or decode server: ``/health``,
    ``/v1/models`` and (chat) completions with ``max_tokens`` tokens and, for a prefill,
    ``kv_transfer_params``. Raw ASGI (no framework) so the stub costs as little as possible."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        path = scope["path"]
        if scope["method"] == "POST" and path.startswith("/v1/"):
            payload = _stub_completion(role, path, json.loads(body or b"{}"))
        elif path == "/v1/models":
            payload = {"object": "list", "data": [{"id": "stub", "object": "model"}]}
        else:
            payload = {"status": "ok"}
        events = payload.pop("_events", None)
        content_type = b"text/event-stream" if events is not None else b"application/json"
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", content_type)],
            }
        )
        if events is None:
            await send({"type": "http.response.body", "body": json.dumps(payload).encode()})
            return
        for event in events:  # one SSE event per token, as a vLLM decode streams them
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    return app


def _stub_completion(role: str, path: str, request: dict[str, Any]) -> dict[str, Any]:
    count = int(request.get("max_tokens") or request.get("max_completion_tokens") or 1)
    text = "".join(f" t{i}" for i in range(count))
    chat = path.endswith("/chat/completions")
    choice: dict[str, Any] = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body: dict[str, Any] = {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": request.get("model", "stub"),
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "completion_tokens": count, "total_tokens": 8 + count},
    }
    if request.get("stream") and role == "decode":
        body["_events"] = [
            b"data: "
            + json.dumps(
                {
                    **body,
                    "choices": [
                        {"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}
                        if not chat
                        else {"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": None}
                    ],
                }
            ).encode()
            + b"\n\n"
            for i in range(count)
        ]
    if role == "prefill":
        body["kv_transfer_params"] = {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [0, 1],
            "remote_engine_id": "stub-prefill",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        }
    return body


def _serve_stub(role: str, port: int) -> None:
    import uvicorn  # noqa: PLC0415 - only the stub subprocess needs it

    uvicorn.run(stub_app(role), host="127.0.0.1", port=port, log_level="warning", access_log=False)


# -- measuring ------------------------------------------------------------------------------------


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


def _percentiles_us(samples: Sequence[int]) -> dict[str, float]:
    p50, p99 = percentiles(samples, (50, 99))
    return {"p50_ms": p50 / 1e3, "p99_ms": p99 / 1e3}


async def _load(
    target: Target,
    connections: int,
    duration_s: float,
    args: argparse.Namespace,
    placement: Placement,
    log_dir: Path,
    body: str = BODY,
) -> dict[str, Any]:
    """One closed-loop window of ``connections`` connections over up to ``--load-processes``
    load processes; CPU of the router, the stubs and the load processes over the window."""
    processes = max(1, min(args.load_processes, connections))
    shares = [connections // processes + (i < connections % processes) for i in range(processes)]
    start_at = time.time() + SPAWN_MARGIN_S + min(1.0, duration_s / 3)
    stop_at = start_at + duration_s
    generators = [
        await start(
            f"loadgen-{i}",
            [
                sys.executable, "-m", "services.bench.loadgen", "run",
                target.url, body, str(share), repr(start_at), repr(stop_at),
            ],
            log_dir,
            cores=placement.others,
            capture_stdout=True,
        )
        for i, share in enumerate(shares)
    ]  # fmt: skip
    outputs = [asyncio.ensure_future(g.communicate()) for g in generators]
    try:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        router_pids = [pid for service in target.router for pid in descendants(service.pid)]
        stub_pids = [pid for service in target.stubs for pid in descendants(service.pid)]
        load_pids = [g.pid for g in generators]
        before = (cpu_seconds(router_pids), cpu_seconds(stub_pids), cpu_seconds(load_pids))
        await asyncio.sleep(max(0.0, stop_at - time.time()))
        after = (cpu_seconds(router_pids), cpu_seconds(stub_pids), cpu_seconds(load_pids))
        results = [json.loads(stdout) for stdout, _ in await asyncio.gather(*outputs)]
    finally:
        for generator in generators:
            await stop(generator)
    latencies = [sample for result in results for sample in result["latencies_us"]]
    completed = len(latencies)
    errors = sum(result["errors"] for result in results)
    router_s, stub_s, load_s = (b - a for a, b in zip(before, after, strict=True))
    per_request = 1e3 / completed if completed else float("nan")
    return {
        "concurrency": connections,
        "requests_per_s": completed / duration_s,
        "errors": errors,
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        **_percentiles_us(latencies),
        "router_cpu_ms_per_request": router_s * per_request,
        "router_cores_used": router_s / duration_s,
        "stub_cpu_ms_per_request": stub_s * per_request,
        "load_generator_cpu_ms_per_request": load_s * per_request,
        "load_generator_processes": processes,
        "_latencies_us": latencies,
    }


async def _measure(
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
    per_token = (
        (high["router_cpu_ms_per_request"] - low["router_cpu_ms_per_request"])
        / (counts[1] - counts[0])
        if clean
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


async def _start_instant(placement: Placement, log_dir: Path) -> tuple[ChildProcess, Target]:
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
    await _wait_http(url, "POST", {}, service=server)
    return server, Target(url, router=[server])


async def _load_generator_figures(
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


async def _wait_http(
    url: str, method: str = "GET", body: Any = None, *, service: ChildProcess | None = None
) -> None:
    """Until ``url`` answers 200; fails at once, with the end of its log, if ``service``
    exits first."""
    deadline = time.monotonic() + START_TIMEOUT_S
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
    raise RuntimeError(f"{url} did not answer 200 within {START_TIMEOUT_S}s{tail}")


# -- the two systems ------------------------------------------------------------------------------


async def _bench_pdserve(
    args: argparse.Namespace,
    settings: ControlPlaneSettings,
    instant: Target,
    placement: Placement,
    log_dir: Path,
    workers: int = 1,
) -> dict[str, Any]:
    cp = ["--redis", settings.redis.url, "--namespace", settings.namespace]
    services: list[ChildProcess] = []
    try:
        for role in ("prefill", "decode"):
            argv = pdserve_argv(
                role, *cp, "--engine", "stub", "--engine-id", f"bench-{role}",
                "--listen", "127.0.0.1:0",
            )  # fmt: skip
            services.append(
                await start(role, argv, log_dir, cores=placement.others, wait_ready_line=True)
            )
        router_flags = ["--port", "0", "--policy", "least_loaded", "--workers", str(workers)]
        router = await start(
            "router",
            pdserve_argv("router", *cp, *router_flags),
            log_dir,
            cores=placement.router,
            wait_ready_line=True,
        )
        services.append(router)
        assert router.announced is not None
        url = str(router.announced["url"])
        await _wait_http(f"{url}/health", service=router)
        target = Target(f"{url}/v1/completions", router=[router], stubs=services[:2])
        return {
            "router_workers": workers,
            **await _measure(target, instant, args, placement, log_dir),
        }
    finally:
        for service in reversed(services):
            await stop(service)


def _vllm_router_binary() -> str | None:
    """The ``vllm-router`` executable (next to this Python first, then on ``PATH``)."""
    beside = Path(sys.executable).parent / "vllm-router"
    return str(beside) if beside.exists() else shutil.which("vllm-router")


async def _bench_vllm_router(
    args: argparse.Namespace,
    binary: str,
    instant: Target,
    placement: Placement,
    log_dir: Path,
) -> dict[str, Any]:
    ports = {"prefill": free_port(), "decode": free_port(), "router": free_port()}
    services: list[ChildProcess] = []
    try:
        for role in ("prefill", "decode"):
            argv = [
                sys.executable, "-m", "services.bench.router", "--serve-stub", role,
                str(ports[role]),
            ]  # fmt: skip
            services.append(await start(f"stub-{role}", argv, log_dir, cores=placement.others))
        for role, stub in zip(("prefill", "decode"), services, strict=True):
            await _wait_http(f"http://127.0.0.1:{ports[role]}/health", service=stub)
        router_argv = [
            binary, "--vllm-pd-disaggregation",
            "--prefill", f"http://127.0.0.1:{ports['prefill']}",
            "--decode", f"http://127.0.0.1:{ports['decode']}",
            "--host", "127.0.0.1", "--port", str(ports["router"]),
            "--policy", "round_robin", "--log-level", "warning",
        ]  # fmt: skip
        router = await start("vllm-router", router_argv, log_dir, cores=placement.router)
        services.append(router)
        url = f"http://127.0.0.1:{ports['router']}"
        await _wait_http(f"{url}/v1/completions", "POST", json.loads(BODY), service=router)
        target = Target(f"{url}/v1/completions", router=[router], stubs=services[:2])
        return await _measure(target, instant, args, placement, log_dir)
    finally:
        for service in reversed(services):
            await stop(service)


async def _run(
    args: argparse.Namespace, settings: ControlPlaneSettings, log_dir: Path
) -> dict[str, Any]:
    split = None if args.pin == "no" else core_split(2 if args.pin == "yes" else None)
    placement = Placement(*split) if split else Placement(None, None)
    load_before = load_average()
    server, instant = await _start_instant(placement, log_dir)
    try:
        generator = await _load_generator_figures(instant, args, placement, log_dir)
        counts = [int(n) for n in str(args.router_workers).split(",") if n.strip()] or [1]
        by_workers = {
            str(n): await _bench_pdserve(args, settings, instant, placement, log_dir, n)
            for n in counts
        }
        pdserve = by_workers[str(counts[0])]
        binary = _vllm_router_binary()
        reference: dict[str, Any]
        if args.skip_vllm_router:
            reference = {"skipped": True}
        elif binary is None:
            reference = {
                "error": f"vllm-router is not installed: pip install '{VLLM_ROUTER_REQUIREMENT}' "
                "(the project's dev extra installs it; `make test` sets it up)"
            }
        else:
            reference = await _bench_vllm_router(args, binary, instant, placement, log_dir)
    finally:
        await stop(server)
    return {
        "benchmark": "router",
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "load_average_before": load_before,
            "load_average_after": load_average(),
            "pinning": placement.describe(),
        },
        "request": {"endpoint": "/v1/completions", "max_tokens": MAX_TOKENS, "stream": False},
        "load_generator": generator,
        "pdserve": pdserve,
        **({"pdserve_by_workers": _by_workers(by_workers)} if len(by_workers) > 1 else {}),
        "vllm_router": reference,
        **({"comparison": _comparison(pdserve, reference)} if "load" in reference else {}),
    }


def _by_workers(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Each worker count's result, and its best rate and router CPU per request next to the
    first count's (``rps_ratio``: does adding workers lose throughput?)."""
    first = next(iter(results.values()))
    summary = {
        count: {
            "max_sustained_rps": result["max_sustained_rps"],
            "router_cpu_ms_per_request": result["router_cpu_ms_per_request"],
            "rps_ratio": result["max_sustained_rps"] / first["max_sustained_rps"]
            if first["max_sustained_rps"]
            else None,
        }
        for count, result in results.items()
    }
    return {"summary": summary, "results": results}


def _comparison(pdserve: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    def both(key: str, inner: str | None = None) -> dict[str, Any]:
        def pick(result: dict[str, Any]) -> Any:
            return result[key][inner] if inner else result[key]

        return {"pdserve": pick(pdserve), "vllm_router": pick(reference)}

    return {
        "rps_ratio": pdserve["max_sustained_rps"] / reference["max_sustained_rps"]
        if reference["max_sustained_rps"]
        else None,
        "router_cpu_ms_per_request": both("router_cpu_ms_per_request"),
        "router_cpu_ratio": pdserve["router_cpu_ms_per_request"]
        / reference["router_cpu_ms_per_request"]
        if pdserve["router_cpu_ms_per_request"] and reference["router_cpu_ms_per_request"]
        else None,
        "added_p50_ms": both("added_latency_ms", "p50_ms"),
        "added_p99_ms": both("added_latency_ms", "p99_ms"),
        "max_sustained_rps": both("max_sustained_rps"),
        "router_cpu_ms_per_extra_token": {
            "pdserve": _per_token(pdserve),
            "vllm_router": _per_token(reference),
        },
    }


def _per_token(result: dict[str, Any]) -> float | None:
    streamed = result.get("streamed")
    return streamed["router_cpu_ms_per_extra_token"] if streamed else None


def run(args: argparse.Namespace, settings: ControlPlaneSettings) -> dict[str, Any]:
    local: LocalRedisServer | None = None
    if args.redis is None:
        local = LocalRedisServer().start()
        settings = settings.model_copy(
            update={"redis": settings.redis.model_copy(update={"url": local.url})}
        )
    settings = settings.model_copy(update={"namespace": f"bench-{uuid.uuid4().hex[:8]}"})
    # Every child's stderr; kept when the run fails (errors name the files), removed after.
    log_dir = Path(tempfile.mkdtemp(prefix="pdserve-bench-router-"))
    try:
        result = asyncio.run(_run(args, settings, log_dir))
        shutil.rmtree(log_dir, ignore_errors=True)
    finally:
        if local is not None:
            local.stop()
    return result


if __name__ == "__main__":  # python -m services.bench.router --serve-stub ROLE PORT
    if len(sys.argv) == 4 and sys.argv[1] == "--serve-stub":
        _serve_stub(sys.argv[2], int(sys.argv[3]))
    else:
        raise SystemExit("usage: python -m services.bench.router --serve-stub prefill|decode PORT")
