"""``pdserve bench router``: the router's own cost, next to vllm-router, in the same run.

Two systems, each a router in front of one instant prefill and one instant decode engine:

- **pdserve**: ``pdserve router`` (subprocess; its front end, vLLM's, over the generated tiny
  checkpoint's tokenizer and chat template) over the control plane (embedded Redis) and two
  ``pdserve prefill|decode --engine stub`` engines (gRPC, no model: tokens are instant, drawn
  from the checkpoint's vocabulary);
- **vllm-router**: ``vllm-router --vllm-pd-disaggregation`` (the Rust router from PyPI, in the
  ``dev`` extra) over two minimal OpenAI-compatible HTTP stubs
  (:func:`services.bench.http_stubs.stub_app`), which answer instantly as a vLLM prefill
  (``max_tokens=1``, ``kv_transfer_params`` back) and a vLLM decode would.

Equal stub work: for a non-streamed request each router makes one prefill call answered in one
message and one decode call answered in one message (pdserve's is a unary ``DecodeOnce``);
pdserve's decode engine checks the KV handle's producer against its
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
  costs the router. A window that completed no request and failed none, or whose CPU
  readings spanned less than half of it (``cpu_coverage``: the bench woke late on a loaded
  machine; a reading after the load reads an idle router), is run again twice as long, up to
  three windows in all (``window_s`` of an entry is how long the reported one lasted: on a
  loaded machine a short window may end before any request does); one that still completed
  none, or was still missed, has no per-request figures (null). CPU read over part of a window
  stands for the whole of it (divided by ``cpu_coverage``).

The load generator is :mod:`services.bench.loadgen` (raw HTTP/1.1, ``--load-processes``
processes), the same for both systems. Its own ceiling against an instant server and its CPU
per request are measured in the same run (``load_generator``). With four or more cores (or
``--pin yes``) the router under test runs pinned to the first core and the stubs and load
generator to the others (``machine.pinning``), so the router never competes with its own load;
the machine's load average before and after says what else ran.

pdserve's router also answers a chat completion of the same prompt (``chat``: router CPU per
request at the best concurrency, beside the completion's); vllm-router's stubs serve no chat.

Optional variants of pdserve's router, measured in the same run over the same stubs:
``--grpcio-client`` (grpc.aio as its engine client instead of h2grpc:
``pdserve_grpcio_client`` and ``engine_client_comparison``), ``--router-workers`` (several
worker processes: ``pdserve_by_workers``). ``--vllm-api-server``: vLLM's own API server on the
tiny model (``vllm_api_server``; :mod:`services.bench.router_frontends`), the front end an
llm-d user runs, beside pdserve's router over the same tokenizer (``frontend_comparison``,
completions and chat).

This module starts the two systems and writes the JSON (the side-by-side ``comparison``); the
windows and their figures are measured by :mod:`services.bench.router_load`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

from services.bench.procs import core_split, load_average, start, stop
from services.bench.router_frontends import (
    TINY_VOCAB,
    bench_vllm_api_server,
    frontend_comparison,
    frontend_flags,
    tiny_model,
)
from services.bench.router_huge import bench_huge_prompts
from services.bench.router_load import (
    BODY,
    MAX_TOKENS,
    Placement,
    Target,
    load_generator_figures,
    measure,
    start_instant,
    wait_http,
)
from services.config import ControlPlaneSettings
from services.control_plane.local_redis import LocalRedisServer, free_port
from services.serving.ready import pdserve_argv
from services.supervision import ChildProcess

VLLM_ROUTER_REQUIREMENT = "vllm-router==0.1.17"


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
        "--grpcio-client",
        action="store_true",
        help="also measure pdserve's router with grpc.aio as its engine client, beside its own "
        "h2grpc client (PDSERVE_ROUTER_ENGINE_GRPC__CLIENT=grpcio)",
    )
    parser.add_argument(
        "--vllm-api-server",
        action="store_true",
        help="also measure vLLM's own API server (python -m vllm.entrypoints.openai.api_server "
        "on the generated tiny checkpoint; slow to start): its process's own CPU per request, "
        "beside pdserve's router (frontend_comparison)",
    )
    parser.add_argument(
        "--huge-prompt-mb",
        type=float,
        default=None,
        help="also measure small requests' p50/p99 quiet and while another client sends a "
        "prompt of this many MB every second (services/bench/router_huge.py; issue 36: 6)",
    )
    parser.add_argument(
        "--router-workers",
        default="1",
        help="comma-separated pdserve router process counts (pdserve router --workers), each "
        "measured in turn; the first is the one compared with vllm-router (default 1)",
    )


# -- the two systems --------------------------------------------------------------


async def _bench_pdserve(
    args: argparse.Namespace,
    settings: ControlPlaneSettings,
    instant: Target,
    placement: Placement,
    log_dir: Path,
    workers: int = 1,
    engine_client: str | None = None,
) -> dict[str, Any]:
    """``engine_client``: the router's gRPC client of the engines
    (``PDSERVE_ROUTER_ENGINE_GRPC__CLIENT``; its default when None)."""
    cp = ["--redis", settings.redis.url, "--namespace", settings.namespace]
    vocab = ["--stub-vocab-size", str(TINY_VOCAB)]
    services: list[ChildProcess] = []
    try:
        for role in ("prefill", "decode"):
            argv = pdserve_argv(
                role, *cp, "--engine", "stub", "--engine-id", f"bench-{role}",
                "--listen", "127.0.0.1:0", *vocab,
            )  # fmt: skip
            services.append(
                await start(role, argv, log_dir, cores=placement.others, wait_ready_line=True)
            )
        router_flags = [
            "--port", "0", "--policy", "least_loaded", "--workers", str(workers),
            *frontend_flags(tiny_model(log_dir)),
        ]  # fmt: skip
        router = await start(
            "router",
            pdserve_argv("router", *cp, *router_flags),
            log_dir,
            cores=placement.router,
            wait_ready_line=True,
            env={"PDSERVE_ROUTER_ENGINE_GRPC__CLIENT": engine_client} if engine_client else None,
        )
        services.append(router)
        assert router.announced is not None
        url = str(router.announced["url"])
        await wait_http(f"{url}/health", service=router)
        target = Target(
            f"{url}/v1/completions",
            router=[router],
            stubs=services[:2],
            chat_url=f"{url}/v1/chat/completions",
        )
        return {
            "router_workers": workers,
            **await measure(target, instant, args, placement, log_dir),
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
                sys.executable, "-m", "services.bench.http_stubs", role, str(ports[role]),
            ]  # fmt: skip
            services.append(await start(f"stub-{role}", argv, log_dir, cores=placement.others))
        for role, stub in zip(("prefill", "decode"), services, strict=True):
            await wait_http(f"http://127.0.0.1:{ports[role]}/health", service=stub)
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
        await wait_http(f"{url}/v1/completions", "POST", json.loads(BODY), service=router)
        target = Target(f"{url}/v1/completions", router=[router], stubs=services[:2])
        return await measure(target, instant, args, placement, log_dir)
    finally:
        for service in reversed(services):
            await stop(service)


async def _run(
    args: argparse.Namespace, settings: ControlPlaneSettings, log_dir: Path
) -> dict[str, Any]:
    split = None if args.pin == "no" else core_split(2 if args.pin == "yes" else None)
    placement = Placement(*split) if split else Placement(None, None)
    load_before = load_average()
    server, instant = await start_instant(placement, log_dir)
    try:
        generator = await load_generator_figures(instant, args, placement, log_dir)
        counts = [int(n) for n in str(args.router_workers).split(",") if n.strip()] or [1]
        by_workers = {
            str(n): await _bench_pdserve(args, settings, instant, placement, log_dir, n)
            for n in counts
        }
        pdserve = by_workers[str(counts[0])]
        fronts: dict[str, dict[str, Any]] = {}
        if args.vllm_api_server:
            fronts["pdserve"] = pdserve
            fronts["vllm_api_server"] = await bench_vllm_api_server(
                args, tiny_model(log_dir), instant, placement, log_dir
            )
        grpcio_client = (
            await _bench_pdserve(
                args, settings, instant, placement, log_dir, engine_client="grpcio"
            )
            if args.grpcio_client
            else None
        )
        huge = (
            await bench_huge_prompts(
                args.huge_prompt_mb, args.latency_s, settings, placement, log_dir
            )
            if args.huge_prompt_mb
            else None
        )
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
        "request": {
            "endpoint": "/v1/completions",
            "max_tokens": MAX_TOKENS,
            "stream": False,
            "chat": "/v1/chat/completions, the same prompt as one user message (not through "
            "vllm-router: its stubs serve completions only)",
        },
        "load_generator": generator,
        "pdserve": pdserve,
        **({"pdserve_by_workers": _by_workers(by_workers)} if len(by_workers) > 1 else {}),
        **(
            {
                "vllm_api_server": fronts["vllm_api_server"],
                "frontend_comparison": frontend_comparison(fronts),
            }
            if fronts
            else {}
        ),
        **(
            {
                "pdserve_grpcio_client": grpcio_client,
                "engine_client_comparison": _client_comparison(pdserve, grpcio_client),
            }
            if grpcio_client is not None
            else {}
        ),
        **({"huge_prompts": huge} if huge is not None else {}),
        "vllm_router": reference,
        **({"comparison": _comparison(pdserve, reference)} if "load" in reference else {}),
    }


def _client_comparison(h2grpc: dict[str, Any], grpcio: dict[str, Any]) -> dict[str, Any]:
    """Router CPU per request and per extra streamed token with its two engine clients:
    h2grpc (the default) and grpc.aio, and the ratio grpc.aio / h2grpc."""
    cpu = (h2grpc["router_cpu_ms_per_request"], grpcio["router_cpu_ms_per_request"])
    return {
        "router_cpu_ms_per_request": {"h2grpc": cpu[0], "grpcio": cpu[1]},
        "router_cpu_ratio": cpu[1] / cpu[0] if cpu[0] and cpu[1] else None,
        "max_sustained_rps": {
            "h2grpc": h2grpc["max_sustained_rps"],
            "grpcio": grpcio["max_sustained_rps"],
        },
        "router_cpu_ms_per_extra_token": {
            "h2grpc": _per_token(h2grpc),
            "grpcio": _per_token(grpcio),
        },
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
