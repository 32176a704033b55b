"""``pdserve bench chaos``: steady load through ``pdserve up`` while engine processes fail.

Starts ``pdserve up`` with two prefill and two decode engines (reference engine on the tiny
checkpoint by default), sends ``--requests`` streaming greedy completions from
``--concurrency`` clients and, each time another ``requests / (faults + 1)`` requests have
finished, the previous fault is over and the target engine has requests in flight again (its
circuit closed; ``target_busy`` says whether that happened within 60 s), injects the next fault
of ``--faults`` (in order):

- ``stop-decode``: SIGSTOP decode-0's rank for ``--idle-timeout-s`` + 3 s (past the router's
  idle bound, which the stack is started with), then SIGCONT;
- ``kill-decode``: SIGKILL decode-0's rank;
- ``kill-prefill``: SIGKILL prefill-0's rank.

Figures (JSON): ``requests``, ``failed`` (must be 0: every fault has a healthy replica),
``migrated`` (requests whose final usage says ``pdserve_migrations``), the router's
``migrations`` and ``prefill_retries`` (deltas of its counters, by reason / phase),
``e2e_ms`` of normal and of migrated requests (p50/p90/p99) and ``migration_added_ms``: the
median end-to-end latency of a migrated request minus a normal one's (what a migration costs
the client: the idle bound for a stalled engine, a re-prefill for a dead one). The load
generator shares the machine with the stack.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from services.bench.procs import descendants
from services.bench.soak import make_prompt, percentiles_ms
from services.bench.sse import StreamFailed, completion_events
from services.bench.up_stack import served_model, wait_endpoints, work_root
from services.supervision import DetachedProcess

FAULTS = ("stop-decode", "kill-decode", "kill-prefill")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", choices=("reference",), default="reference")
    parser.add_argument("--requests", type=int, default=400, help="requests in all")
    parser.add_argument("--concurrency", type=int, default=12, help="concurrent clients")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per request")
    parser.add_argument(
        "--faults",
        default=",".join(FAULTS),
        help=f"comma-separated faults, injected in order ({', '.join(FAULTS)})",
    )
    parser.add_argument(
        "--idle-timeout-s",
        type=float,
        default=10.0,
        help="the router's decode idle bound (and prefill deadline) for this run",
    )
    parser.add_argument("--request-timeout-s", type=float, default=180.0)
    parser.add_argument("--model", type=Path, default=None, help="model folder (default: tiny)")
    parser.add_argument("--work-dir", type=Path, default=None, help="default: a temporary one")
    parser.add_argument("--ready-timeout-s", type=float, default=300.0)


@dataclass
class Outcome:
    ok: bool = False
    e2e_s: float = 0.0
    migrations: int = 0
    error: str | None = None


def run(args: argparse.Namespace) -> dict[str, Any]:
    faults = [f for f in str(args.faults).split(",") if f]
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise SystemExit(f"pdserve bench chaos: unknown fault(s) {unknown}; known: {FAULTS}")
    with work_root(args.work_dir, "chaos") as work_dir:
        return _run_in(args, faults, work_dir)
    raise AssertionError("unreachable")  # pragma: no cover


def _run_in(args: argparse.Namespace, faults: list[str], work_dir: Path) -> dict[str, Any]:
    up = _start_up(work_dir, args)
    injected: list[dict[str, Any]] = []
    try:
        endpoints = wait_endpoints(up, work_dir, args.ready_timeout_s)
        router = str(endpoints["router"])
        model = served_model(router)
        before = _router_counters(router)
        started = time.perf_counter()
        outcomes = asyncio.run(_load(args, endpoints, model, faults, injected))
        elapsed = time.perf_counter() - started
        after = _router_counters(router)
    finally:
        status = up.stop()
    return _summarize(args, outcomes, elapsed, before, after, injected, status)


def _start_up(work_dir: Path, args: argparse.Namespace) -> DetachedProcess:
    bound = str(args.idle_timeout_s)
    return DetachedProcess.pdserve_up(
        work_dir,
        "--engine",
        args.engine,
        "--prefill-replicas",
        "2",
        "--decode-replicas",
        "2",
        *(["--model", str(args.model)] if args.model is not None else []),
        env={
            "PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2",
            "PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S": bound,
            "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": bound,
        },
    )


def _rank_of(endpoints: dict[str, Any], engine: str) -> int:
    engine_pid = int(endpoints["engines"][engine]["pid"])
    for pid in descendants(engine_pid)[1:]:
        with contextlib.suppress(OSError):
            if b"resource_tracker" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise RuntimeError(f"no rank process under {engine} ({engine_pid})")


async def _inject(fault: str, endpoints: dict[str, Any], idle_timeout_s: float) -> None:
    if fault == "stop-decode":
        rank = _rank_of(endpoints, "decode-0")
        os.kill(rank, signal.SIGSTOP)
        try:
            await asyncio.sleep(idle_timeout_s + 3)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(rank, signal.SIGCONT)
    elif fault == "kill-decode":
        os.kill(_rank_of(endpoints, "decode-0"), signal.SIGKILL)
    else:
        os.kill(_rank_of(endpoints, "prefill-0"), signal.SIGKILL)


async def _load(
    args: argparse.Namespace,
    endpoints: dict[str, Any],
    model: str,
    faults: list[str],
    injected: list[dict[str, Any]],
) -> list[Outcome]:
    rng = random.Random(3)
    prompts = [make_prompt(i, (6, 24, 64)[i % 3], rng) for i in range(args.requests)]
    queue: asyncio.Queue[str] = asyncio.Queue()
    for prompt in prompts:
        queue.put_nowait(prompt)
    outcomes: list[Outcome] = []
    every = max(args.requests // (len(faults) + 1), 1)
    start = time.perf_counter()
    progress = asyncio.Event()
    limits = httpx.Limits(max_connections=args.concurrency + 2, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=str(endpoints["router"]), limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                prompt = queue.get_nowait()
                outcomes.append(await _request(client, model, prompt, args))
                progress.set()

        async def driver() -> None:
            """Each fault after its share of requests, once the previous one is over and the
            target engine has requests in flight again (so it strikes mid-stream)."""
            for index, fault in enumerate(faults):
                while len(outcomes) < every * (index + 1) and not queue.empty():
                    progress.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(progress.wait(), 1.0)
                if queue.empty():
                    injected.append({"fault": fault, "skipped": "the load ended first"})
                    continue
                target = "prefill-0" if fault == "kill-prefill" else "decode-0"
                waited = await _until_busy(client, target, bound_s=60.0)
                injected.append(
                    {
                        "fault": fault,
                        "after_requests": len(outcomes),
                        "at_s": round(time.perf_counter() - start, 2),
                        "target_busy": waited,
                    }
                )
                await _inject(fault, endpoints, args.idle_timeout_s)

        workers = [worker() for _ in range(min(args.concurrency, args.requests))]
        await asyncio.gather(driver(), *workers)
    return outcomes


async def _until_busy(client: httpx.AsyncClient, engine: str, *, bound_s: float) -> bool:
    """Wait (at most ``bound_s``) until the router has requests in flight on ``engine`` with
    its circuit closed; whether that happened."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        text = (await client.get("/metrics")).text
        busy = closed = False
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("engine") != engine:
                    continue
                if sample.name == "pdserve_router_engine_inflight":
                    busy = sample.value > 0
                elif sample.name == "pdserve_router_engine_circuit_state":
                    closed = closed or (sample.labels["state"] == "closed" and sample.value == 1)
        if busy and closed:
            return True
        await asyncio.sleep(0.1)
    return False


async def _request(
    client: httpx.AsyncClient, model: str, prompt: str, args: argparse.Namespace
) -> Outcome:
    """One streamed completion; never raises."""
    outcome = Outcome()
    sent = time.perf_counter()
    try:
        async with asyncio.timeout(args.request_timeout_s):
            await _stream(client, model, prompt, args.max_tokens, outcome)
    except TimeoutError:
        outcome.error = f"client timeout after {args.request_timeout_s}s"
    except httpx.HTTPError as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"
    outcome.e2e_s = time.perf_counter() - sent
    return outcome


async def _stream(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, outcome: Outcome
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body, timeout=None) as reply:
        try:
            async for event in completion_events(reply):
                if event.get("usage"):
                    tokens = int(event["usage"]["completion_tokens"])
                    outcome.migrations = int(event["usage"].get("pdserve_migrations", 0))
        except StreamFailed as exc:
            outcome.error = str(exc)
            return
    outcome.ok = tokens == max_tokens
    if not outcome.ok:
        outcome.error = f"{tokens} of {max_tokens} tokens"


def _router_counters(router: str) -> dict[str, float]:
    """The router's migration and prefill-retry counters, by reason / phase."""
    text = httpx.get(f"{router}/metrics", timeout=10).text
    counters: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "pdserve_router_migrations_total":
                key = f"migrations/{sample.labels['reason']}"
            elif sample.name == "pdserve_router_prefill_retries_total":
                key = f"prefill_retries/{sample.labels['phase']}/{sample.labels['reason']}"
            else:
                continue
            counters[key] = counters.get(key, 0.0) + sample.value
    return counters


def _summarize(
    args: argparse.Namespace,
    outcomes: list[Outcome],
    elapsed_s: float,
    before: dict[str, float],
    after: dict[str, float],
    injected: list[dict[str, Any]],
    up_status: int,
) -> dict[str, Any]:
    failed = [o for o in outcomes if not o.ok]
    migrated = [o for o in outcomes if o.ok and o.migrations]
    normal = [o for o in outcomes if o.ok and not o.migrations]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    added = (
        round(
            (
                statistics.median(o.e2e_s for o in migrated)
                - statistics.median(o.e2e_s for o in normal)
            )
            * 1000,
            1,
        )
        if migrated and normal
        else None
    )
    return {
        "engine": args.engine,
        "requests": len(outcomes),
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "faults": injected,
        "failed": len(failed),
        "failed_samples": sorted({o.error or "" for o in failed})[:5],
        "migrated": len(migrated),
        "migrations": {
            k.split("/", 1)[1]: int(v)
            for k, v in delta.items()
            if v and k.startswith("migrations/")
        },
        "retried": int(sum(v for k, v in delta.items() if k.startswith("prefill_retries/"))),
        "prefill_retries": {
            k.split("/", 1)[1]: int(v)
            for k, v in delta.items()
            if v and k.startswith("prefill_retries/")
        },
        "e2e_ms": {
            "normal": percentiles_ms([o.e2e_s for o in normal]),
            "migrated": percentiles_ms([o.e2e_s for o in migrated]),
        },
        "migration_added_ms": added,
        "duration_s": round(elapsed_s, 2),
        "up_exit_status": up_status,
        "machine": {"cpus": os.cpu_count()},
    }
