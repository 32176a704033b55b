"""Closes started in the background: held until they end, a failure logged by name (never
asyncio's "Task exception was never retrieved"), all awaited on wait()."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from services.router.scheduling.closing import BackgroundCloses


async def test_a_failed_close_is_logged_by_name_and_never_left_unretrieved(
    caplog: pytest.LogCaptureFixture,
) -> None:
    closed: list[str] = []
    gate = asyncio.Event()

    async def close(name: str, fail: bool) -> None:
        await gate.wait()
        if fail:
            raise ConnectionResetError(f"{name}: peer gone")
        closed.append(name)

    unretrieved: list[object] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, context: unretrieved.append(context))
    closes = BackgroundCloses("a departed engine's connector")
    with caplog.at_level(logging.WARNING, logger="services.router.scheduling.closing"):
        closes.start(close("a", fail=False))
        closes.start(close("b", fail=True))
        gate.set()
        await closes.wait()
        for _ in range(3):  # the failed task is gone: nothing is left to report it later
            await asyncio.sleep(0)
        gc.collect()
    assert closed == ["a"]
    assert "closing a departed engine's connector failed: ConnectionResetError('b: peer gone')" in (
        caplog.text
    )
    assert unretrieved == []
    await closes.wait()  # nothing under way: returns


def test_with_no_running_loop_the_close_is_not_run_and_not_left_unawaited() -> None:
    ran: list[bool] = []

    async def close() -> None:
        ran.append(True)

    BackgroundCloses("x").start(close())  # no "coroutine was never awaited" warning either
    assert ran == []
