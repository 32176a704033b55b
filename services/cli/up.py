"""``pdserve up``: the whole system on one machine, with a live readiness display.

Starts the embedded Redis (unless ``--redis`` names one) and shows every engine's per-rank
readiness as it changes, until Ctrl-C, which stops everything it started.

Today it brings up the control plane; the reference engines, their services and the router join
it as they land (see docs/architecture.md, "Status").
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path

from services.cli.settings import ToolSettings
from services.cli.status import describe, render_table
from services.config import ControlPlaneSettings
from services.control_plane import RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--work-dir", type=Path, default=Path(".run"), help="where run-time files go"
    )
    parser.add_argument(
        "--redis-port", type=int, default=None, help="port of the embedded Redis (default: free)"
    )
    parser.add_argument(
        "--exit-after", type=float, default=None, help="stop after this many seconds (tests)"
    )


def run(args: argparse.Namespace, settings: ToolSettings) -> int:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    redis_server: LocalRedisServer | None = None
    control_plane = settings.control_plane
    if args.redis is None:
        redis_server = LocalRedisServer(port=args.redis_port).start()
        control_plane = control_plane.model_copy(
            update={"redis": control_plane.redis.model_copy(update={"url": redis_server.url})}
        )
    url = control_plane.redis.url
    (args.work_dir / "redis.url").write_text(url + "\n")
    print(f"pdserve up: control plane Redis at {url} (namespace {control_plane.namespace!r})")
    print(f"  inspect it with:  pdserve status --redis {url}")
    print("  Ctrl-C stops everything this command started.", flush=True)
    try:
        asyncio.run(_display(control_plane, args.exit_after))
    finally:
        if redis_server is not None:
            redis_server.stop()
            print("pdserve up: stopped the embedded Redis")
    return 0


async def _display(settings: ControlPlaneSettings, exit_after: float | None) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if exit_after is not None:
        loop.call_later(exit_after, stop.set)
    control_plane = RedisControlPlane(settings)
    try:
        async with control_plane.watch(handshake_progress=True) as watcher:
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    change = await watcher.next_change(0.5)
                    inspection = await control_plane.inspect(change.engine_id)
                    if inspection is None:
                        print(f"engine {change.engine_id} gone", flush=True)
                    else:
                        print(render_table([describe(inspection)], settings.namespace), flush=True)
    finally:
        await control_plane.close()
