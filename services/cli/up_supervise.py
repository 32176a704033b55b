"""``pdserve up`` once everything is READY: keep the engines running until Ctrl-C.

An engine process that exits on its own (its host crashed or was killed; a dead rank makes its
host exit too) is reported with the end of its log and, unless ``--no-restart``, started again
after the back-off of its :class:`~services.supervision.RestartTracker`: it registers a new
generation with the control plane, the router picks it up from its watcher, and
``endpoints.json`` is rewritten (its new pid, gRPC and ``/metrics`` addresses, its
``restarts``). A crash loop (more than ``--restart-limit`` fast failures in a row) ends its
restarts with an error line; the other engines keep serving. The router exiting ends the run
with status 1. With ``--autoscale`` the set of engines changes while it runs
(:mod:`services.cli.up_autoscale`): :class:`KeptEngines` keeps the ones added and lets go of
the ones released.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable, Callable, Sequence

from services.supervision import ChildExited, ChildProcess, RestartPolicy, RestartTracker


class KeptEngines:
    """The engines ``pdserve up`` keeps: each one is restarted when it exits on its own (as
    its tracker decides) until it is released or the run stops. ``on_change`` is called with
    every engine's tracker after an engine was restarted or given up on."""

    def __init__(
        self,
        stop: asyncio.Event,
        *,
        policy: RestartPolicy,
        ready_timeout_s: float,
        on_change: Callable[[dict[str, RestartTracker]], None],
    ) -> None:
        self.stop = stop
        self.policy = policy
        self.ready_timeout_s = ready_timeout_s
        self.on_change = on_change
        self.trackers: dict[str, RestartTracker] = {}
        self._keepers: dict[str, asyncio.Task[None]] = {}

    def keep(self, engine: ChildProcess) -> None:
        """Watch ``engine`` (started and READY) from now on."""
        tracker = self.trackers.setdefault(engine.name, RestartTracker(self.policy))
        self._keepers[engine.name] = asyncio.create_task(
            _keep(engine, tracker, self.stop, self.ready_timeout_s, self.changed)
        )

    def changed(self) -> None:
        self.on_change(self.trackers)

    async def release(self, engine: ChildProcess, timeout_s: float) -> bool:
        """Stop keeping ``engine`` and stop it: SIGTERM, so its host drains (no new requests;
        those in flight finish, held KV is released) and deregisters, within ``timeout_s``;
        then whatever is left is killed. Whether it stopped within the bound."""
        keeper = self._keepers.pop(engine.name, None)
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        self.trackers.pop(engine.name, None)
        return await engine.stop(timeout_s, group=False)

    async def close(self) -> None:
        keepers = list(self._keepers.values())
        self._keepers.clear()
        for keeper in keepers:
            keeper.cancel()
        for keeper in keepers:
            with contextlib.suppress(asyncio.CancelledError):
                await keeper


async def supervise(
    engines: Sequence[ChildProcess],
    router: ChildProcess,
    stop: asyncio.Event,
    *,
    policy: RestartPolicy,
    ready_timeout_s: float,
    on_change: Callable[[dict[str, RestartTracker]], None],
    alongside: Callable[[KeptEngines], Awaitable[None]] | None = None,
) -> int:
    """Until ``stop`` (0) or the router's exit (1). ``alongside`` (the autoscaler) runs with
    the kept engines until then; its end (or failure) ends nothing else."""
    kept = KeptEngines(stop, policy=policy, ready_timeout_s=ready_timeout_s, on_change=on_change)
    for engine in engines:
        kept.keep(engine)
    helper = asyncio.ensure_future(alongside(kept)) if alongside is not None else None
    router_exit = asyncio.ensure_future(router.wait())
    stopped = asyncio.ensure_future(stop.wait())
    try:
        done, _ = await asyncio.wait({router_exit, stopped}, return_when=asyncio.FIRST_COMPLETED)
        if stopped in done:
            return 0
        print(f"pdserve up: {router.describe_exit()}", file=sys.stderr, flush=True)
        return 1
    finally:
        for task in (router_exit, stopped, *([helper] if helper is not None else [])):
            task.cancel()
        if helper is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await helper
        await kept.close()


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
