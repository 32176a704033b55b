"""``pdserve bench control-plane``: how fast an engine's full grid turns READY for a watcher.

For each engine count (1, 16, 64 by default) engines of 16 ranks (PP=4 x TP=4) register and stay
live; then their workers publish their handshake records through a pool of clients, as separate
worker processes would. ``staggered``: engines come up one after another, each engine's 16
workers at once (the watcher tracks all of them). ``burst``: every worker of every engine at once,
from this one process: on a small machine that mostly measures this process's CPU queue, and it
is reported as such. A watcher in a separate process (its own Redis connection,
pub/sub plus re-read, exactly as a router or decode engine watches) stamps the moment it sees
each engine READY. Figures:

- ``ready_latency_ms``: from the start of the publish that completed an engine's grid to the
  watcher seeing READY (p50, p99, max);
- ``round_trips_per_worker``: Redis round trips spent by publishers per worker (constant in the
  number of engines and ranks when the protocol is right: 1, plus 1 for the completing worker).

When no ``--redis`` is given the benchmark starts its own local ``redis-server``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing
import statistics
import time
import uuid
from multiprocessing.connection import Connection
from typing import Any

from services.bench.stats import percentiles
from services.config import ControlPlaneSettings
from services.control_plane import ControlPlaneMetrics, EngineRecord, RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.synthetic import synthetic_records, synthetic_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines", default="1,16,64", help="comma-separated engine counts (default 1,16,64)"
    )
    parser.add_argument("--pp", type=int, default=4, help="PP size of each engine")
    parser.add_argument("--tp", type=int, default=4, help="TP size of each engine")
    parser.add_argument(
        "--min-samples", type=int, default=64, help="repeat small rounds up to this many samples"
    )
    parser.add_argument("--publishers", type=int, default=64, help="concurrent publisher clients")
    parser.add_argument(
        "--mode",
        choices=["staggered", "burst", "both"],
        default="both",
        help="staggered: engines come up one after another (all live and watched); "
        "burst: every worker of every engine publishes at once from this one process",
    )


def run(args: argparse.Namespace, settings: ControlPlaneSettings) -> dict[str, Any]:
    counts = [int(n) for n in args.engines.split(",") if n.strip()]
    local: LocalRedisServer | None = None
    if args.redis is None:
        local = LocalRedisServer().start()
        settings = settings.model_copy(
            update={"redis": settings.redis.model_copy(update={"url": local.url})}
        )
    try:
        namespace = f"bench-{uuid.uuid4().hex[:8]}"
        settings = settings.model_copy(update={"namespace": namespace, "lease_ttl_s": 120.0})
        modes = ["staggered", "burst"] if args.mode == "both" else [args.mode]
        results = [
            _run_count(settings, count, args.pp, args.tp, args.min_samples, args.publishers, mode)
            for mode in modes
            for count in counts
        ]
    finally:
        if local is not None:
            local.stop()
    return {
        "benchmark": "control-plane",
        "ranks_per_engine": args.pp * args.tp,
        "layout": {"pp": args.pp, "tp": args.tp},
        "goal": "p99 ready latency < 20 ms at 64 engines; constant round trips per worker",
        "results": results,
    }


def _run_count(
    settings: ControlPlaneSettings,
    count: int,
    pp: int,
    tp: int,
    min_samples: int,
    publishers: int,
    mode: str,
) -> dict[str, Any]:
    rounds = max(1, -(-min_samples // count))
    context = multiprocessing.get_context("spawn")
    parent, child = context.Pipe()
    watcher = context.Process(target=_watcher_main, args=(settings.model_dump_json(), child))
    watcher.start()
    try:
        if not parent.poll(30):
            raise RuntimeError("benchmark watcher did not start")
        parent.recv()  # "ready": subscribed and synced
        figures = asyncio.run(_publish_rounds(settings, count, pp, tp, rounds, publishers, mode))
        parent.send(("done", figures["expected_ready"]))
        seen: dict[str, float] = parent.recv()
    finally:
        watcher.join(timeout=30)
        if watcher.is_alive():
            watcher.kill()
    latencies = [
        (seen[key] - start) * 1000
        for key, start in figures["completing_publish_start"].items()
        if key in seen
    ]
    missed = figures["expected_ready"] - len(latencies)
    latencies.sort()
    p50, p99 = percentiles(latencies, (50, 99))
    return {
        "mode": mode,
        "engines": count,
        "rounds": rounds,
        "samples": len(latencies),
        "missed": missed,
        "ready_latency_ms": {
            "p50": round(p50, 3),
            "p99": round(p99, 3),
            "max": round(latencies[-1], 3) if latencies else None,
            "mean": round(statistics.fmean(latencies), 3) if latencies else None,
        },
        "round_trips_per_worker": round(figures["publish_round_trips"] / figures["workers"], 3),
        "publish_wall_s": round(figures["publish_wall_s"], 4),
    }


async def _publish_rounds(
    settings: ControlPlaneSettings,
    count: int,
    pp: int,
    tp: int,
    rounds: int,
    publishers: int,
    mode: str,
) -> dict[str, Any]:
    admin = RedisControlPlane(settings, ControlPlaneMetrics())
    clients = [RedisControlPlane(settings, ControlPlaneMetrics()) for _ in range(publishers)]
    completing_start: dict[str, float] = {}
    engines: list[EngineRecord] = []
    workers = 0
    wall = 0.0

    async def publish(slot: int, engine: EngineRecord, record: Any) -> None:
        client = clients[slot % len(clients)]
        started = time.monotonic()
        status = await client.publish_handshakes(engine, [record])
        if status is not None:
            completing_start[f"{engine.engine_id}@{engine.generation}"] = started

    try:
        for client in clients:  # connect up front: connection set-up is not a publish cost
            await client.connection.client.ping()
        baseline = sum(c.round_trips for c in clients)
        for round_index in range(rounds):
            batch = [
                await admin.register(
                    synthetic_spec(
                        f"bench-{mode}-{round_index}-{index}", pp_size=pp, tp_size=tp, num_layers=32
                    )
                )
                for index in range(count)
            ]
            engines += batch
            # staggered: one engine's workers at a time, every engine live and watched;
            # burst: every worker of every engine at once, from this one process.
            groups = [batch] if mode == "burst" else [[engine] for engine in batch]
            for group in groups:
                jobs = [(e, r) for e in group for r in synthetic_records(e).values()]
                workers += len(jobs)
                began = time.monotonic()
                await asyncio.gather(*(publish(i, e, r) for i, (e, r) in enumerate(jobs)))
                wall += time.monotonic() - began
        round_trips = sum(c.round_trips for c in clients) - baseline
        await asyncio.sleep(0.5)  # let the watcher see the last READY before engines go
        for engine in engines:
            await admin.deregister(engine.engine_id, engine.generation)
    finally:
        await admin.close()
        for client in clients:
            await client.close()
    return {
        "completing_publish_start": completing_start,
        "expected_ready": count * rounds,
        "publish_round_trips": round_trips,
        "workers": workers,
        "publish_wall_s": wall,
    }


def _watcher_main(settings_json: str, pipe: Connection) -> None:
    settings = ControlPlaneSettings.model_validate_json(settings_json)
    asyncio.run(_watch(settings, pipe))


async def _watch(settings: ControlPlaneSettings, pipe: Connection) -> None:
    control_plane = RedisControlPlane(settings, ControlPlaneMetrics())
    seen: dict[str, float] = {}
    try:
        async with control_plane.watch() as watcher:
            pipe.send("ready")
            expected: int | None = None
            deadline = float("inf")
            while expected is None or (len(seen) < expected and time.monotonic() < deadline):
                if expected is None and pipe.poll():
                    _, expected = pipe.recv()
                    deadline = time.monotonic() + 10  # READYs still missing then are reported
                with contextlib.suppress(TimeoutError):
                    change = await watcher.next_change(0.05)
                    if change.became_ready and change.after and change.after.record:
                        key = f"{change.engine_id}@{change.after.record.generation}"
                        seen.setdefault(key, time.monotonic())
    finally:
        pipe.send(seen)
        await control_plane.close()
