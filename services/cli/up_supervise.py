"""``pdserve up`` once everything is READY: keep the engines running until Ctrl-C.

An engine process that exits on its own (its host crashed or was killed; a dead rank makes its
host exit too) is reported with the end of its log and, unless ``--no-restart``, started again
after the back-off of its :class:`~services.supervision.RestartTracker`: it registers a new
generation with the control plane, the router picks it up from its watcher, and
``endpoints.json`` is rewritten (its new pid, gRPC and ``/metrics`` addresses, its
``restarts``). A crash loop (more than ``--restart-limit`` fast failures in a row) ends its
restarts with an error line; the other engines keep serving. The router exiting ends the run
with status 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Callable, Sequence

from services.supervision import ChildExited, ChildProcess, RestartPolicy, RestartTracker


async def supervise(
    engines: Sequence[ChildProcess],
    router: ChildProcess,
    stop: asyncio.Event,
    *,
    policy: RestartPolicy,
    ready_timeout_s: float,
    on_change: Callable[[dict[str, RestartTracker]], None],
) -> int:
    """Until ``stop`` (0) or the router's exit (1); ``on_change`` is called with every engine's
    tracker after an engine was restarted or given up on."""
    trackers = {engine.name: RestartTracker(policy) for engine in engines}
    keepers = [
        asyncio.create_task(
            _keep(engine, trackers[engine.name], stop, ready_timeout_s, lambda: on_change(trackers))
        )
        for engine in engines
    ]
    router_exit = asyncio.ensure_future(router.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({router_exit, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped in done:
            return 0
        print(f"pdserve up: {router.describe_exit()}", file=sys.stderr, flush=True)
        return 1
    finally:
        for task in (*keepers, router_exit, stopped):
            task.cancel()
        for keeper in keepers:
            with contextlib.suppress(asyncio.CancelledError):
                await keeper


async def _keep(
    engine: ChildProcess,
    tracker: RestartTracker,
    stop: asyncio.Event,
    ready_timeout_s: float,
    on_change: Callable[[], None],
) -> None:
    """Report each exit of ``engine`` and restart it while its tracker says so."""
    while True:
        await engine.wait()
        if stop.is_set():
            return
        served = engine.served_s()
        print(f"pdserve up: {engine.describe_exit()}", file=sys.stderr, flush=True)
        decision = tracker.on_exit(served)
        if not decision.restart:
            if tracker.gave_up:
                print(
                    f"pdserve up: error: {engine.name} is not restarted again: "
                    f"{decision.reason}; see {engine.log_path}",
                    file=sys.stderr,
                    flush=True,
                )
                on_change()
            return
        print(f"pdserve up: {engine.name} exited; {decision.reason}", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), decision.delay_s)
        if stop.is_set():
            return
        await engine.start()
        try:
            announced = await engine.wait_ready(ready_timeout_s)
        except ChildExited:
            continue  # reported and decided on at the top of the loop
        except TimeoutError:
            print(
                f"pdserve up: {engine.name} not READY within {ready_timeout_s}s of its restart; "
                "killing it",
                file=sys.stderr,
                flush=True,
            )
            await engine.kill()
            continue
        print(
            f"pdserve up: {engine.name} restarted (restart {tracker.restarts}, pid {engine.pid}, "
            f"generation {announced.get('generation')})",
            flush=True,
        )
        on_change()
