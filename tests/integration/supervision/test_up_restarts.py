"""``pdserve up``'s engine keeper (:func:`services.cli.up_supervise.supervise`) with real child
processes standing in for engines: a crashing one is restarted with back-off until the crash
loop ends its restarts, one that serves is left alone, and the router's exit ends the run."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from services.cli.up_supervise import supervise
from services.supervision import ChildProcess, RestartPolicy, RestartTracker

pytestmark = pytest.mark.integration

BOUND_S = 120.0

SERVES = "print('PDSERVE_READY {\"generation\": 1}', flush=True); import time; time.sleep(600)"
CRASHES = "print('PDSERVE_READY {\"generation\": 1}', flush=True); raise SystemExit(3)"


def child(name: str, code: str, tmp_path: Path, role: str) -> ChildProcess:
    return ChildProcess(name, [sys.executable, "-c", code], tmp_path / f"{name}.log", role=role)


async def test_a_crash_loop_is_restarted_with_back_off_then_given_up_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crashing = child("prefill-0", CRASHES, tmp_path, "prefill")
    serving = child("decode-0", SERVES, tmp_path, "decode")
    router = child("router", SERVES, tmp_path, "router")
    for process in (crashing, serving, router):
        await process.start()
        await process.wait_ready(BOUND_S)
    changes: list[dict[str, RestartTracker]] = []
    gave_up = asyncio.Event()

    def on_change(trackers: dict[str, RestartTracker]) -> None:
        changes.append(trackers)
        if trackers["prefill-0"].gave_up:
            gave_up.set()

    stop = asyncio.Event()
    policy = RestartPolicy(max_fast_failures=2, stable_after_s=600, backoff_s=0.05)
    run = asyncio.create_task(
        supervise(
            [crashing, serving],
            router,
            stop,
            policy=policy,
            ready_timeout_s=BOUND_S,
            on_change=on_change,
        )
    )
    try:
        await asyncio.wait_for(gave_up.wait(), BOUND_S)
        trackers = changes[-1]
        assert crashing.starts == 3  # the first run and two restarts
        assert trackers["prefill-0"].restarts == 2 and trackers["prefill-0"].gave_up
        assert trackers["decode-0"].restarts == 0 and serving.running
        router.send_signal(15)
        assert await asyncio.wait_for(run, BOUND_S) == 1  # the router's exit ends the run
    finally:
        stop.set()
        for process in (crashing, serving, router):
            await process.stop(BOUND_S)
    out, err = capsys.readouterr()
    assert "prefill-0 exited; restart 1 in 0.05s (1 fast failure(s) in a row)" in out
    assert "prefill-0 exited; restart 2 in 0.1s (2 fast failure(s) in a row)" in out
    assert "prefill-0 restarted (restart 2" in out
    assert "error: prefill-0 is not restarted again: crash loop: 3 failures in a row" in err
    assert "router exited with status -15" in err


async def test_with_restarts_off_an_exit_is_reported_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    crashing = child("prefill-0", CRASHES, tmp_path, "prefill")
    router = child("router", SERVES, tmp_path, "router")
    for process in (crashing, router):
        await process.start()
    stop = asyncio.Event()
    run = asyncio.create_task(
        supervise(
            [crashing],
            router,
            stop,
            policy=RestartPolicy(enabled=False),
            ready_timeout_s=BOUND_S,
            on_change=lambda _: None,
        )
    )
    try:
        # The keeper reports the exit and decides at once (no await in between).
        err = ""
        async with asyncio.timeout(BOUND_S):
            while "prefill-0 exited with status 3" not in err:
                err += capsys.readouterr().err
                await asyncio.sleep(0.05)
        stop.set()
        assert await asyncio.wait_for(run, BOUND_S) == 0
    finally:
        for process in (crashing, router):
            await process.stop(BOUND_S)
    assert crashing.starts == 1
    assert "exited; restart" not in err + capsys.readouterr().out
