"""The one supervisor of child processes with real processes (``python -c``): READY line, log,
exit before READY, restart, the ordered stop, and SIGKILL of what ignores SIGTERM."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from services.serving.ready import format_ready_line
from services.supervision import ChildExited, ChildProcess, stop_in_order

pytestmark = pytest.mark.integration

BOUND_S = 60.0
"""Generous: the machine is loaded."""


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def announcing(payload: str, then: str = "import time; time.sleep(600)") -> list[str]:
    return python(
        "import os, sys\n"
        f"print('before', os.environ['MARK'])\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        f"print({format_ready_line({'n': 1})!r}.replace('1', {payload!r}), flush=True)\n"
        f"{then}\n"
    )


async def test_the_ready_line_is_read_and_every_output_goes_to_the_log(tmp_path: Path) -> None:
    child = ChildProcess("one", announcing("7"), tmp_path / "one.log", env={"MARK": "m1"})
    await child.start()
    try:
        assert await child.wait_ready(BOUND_S) == {"n": 7}
        assert child.served_s() is not None
    finally:
        assert await child.stop(BOUND_S)
    log = (tmp_path / "one.log").read_text()
    assert "before m1" in log and "PDSERVE_READY" in log and "to stderr" in log
    assert child.returncode == -signal.SIGTERM


async def test_an_exit_before_the_ready_line_says_how_with_its_log(tmp_path: Path) -> None:
    child = ChildProcess(
        "dies", python("import sys; print('boom', file=sys.stderr); sys.exit(3)"), tmp_path / "d"
    )
    await child.start()
    with pytest.raises(ChildExited, match=r"dies exited with status 3(.|\n)*boom"):
        await child.wait_ready(BOUND_S)
    assert child.served_s() is None


async def test_a_restart_runs_it_again_with_a_new_announcement(tmp_path: Path) -> None:
    child = ChildProcess(
        "again", announcing("1", then="raise SystemExit(1)"), tmp_path / "a", env={"MARK": "x"}
    )
    await child.start()
    await child.wait_ready(BOUND_S)
    first = child.pid
    assert await asyncio.wait_for(child.wait(), BOUND_S) == 1
    child.argv = announcing("2")
    await child.start()
    try:
        assert await child.wait_ready(BOUND_S) == {"n": 2}
        assert child.pid != first and child.starts == 2
    finally:
        await child.stop(BOUND_S)
    assert (tmp_path / "a").read_text().count("PDSERVE_READY") == 2  # the log was appended to


async def test_stop_in_order_terminates_groups_in_turn_and_kills_what_ignores_sigterm(
    tmp_path: Path,
) -> None:
    order = tmp_path / "order"
    # Each child notes its SIGTERM in a shared file and exits; "stubborn" ignores it.
    polite = (
        "import signal, sys, time\n"
        "def bye(*_):\n"
        f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, bye)\n"
        "print('PDSERVE_READY {}', flush=True)\n"
        "time.sleep(600)\n"
    )
    stubborn = (
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('PDSERVE_READY {}', flush=True)\n"
        "time.sleep(600)\n"
    )
    first = ChildProcess("first", [*python(polite), "first"], tmp_path / "1")
    second = ChildProcess("second", [*python(polite), "second"], tmp_path / "2")
    third = ChildProcess("third", python(stubborn), tmp_path / "3")
    children = [first, second, third]
    for child in children:
        await child.start()
    for child in children:
        await child.wait_ready(BOUND_S)
    late: list[str] = []
    await stop_in_order([[first], [second, third]], 0.5, on_late=lambda c: late.append(c.name))
    assert order.read_text().split() == ["first", "second"]
    assert late == ["third"]
    assert third.returncode == -signal.SIGKILL
    for child in children:
        with pytest.raises(ProcessLookupError):
            os.killpg(child.pid, 0)
