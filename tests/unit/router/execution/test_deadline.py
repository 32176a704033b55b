"""``StreamBounds``: one timer per engine stream for the idle and whole-call bounds."""

from __future__ import annotations

import asyncio

import pytest

from services.router.execution.deadline import StreamBounds

SHORT_S = 0.05
LONG_S = 30.0


async def _wait(bounds: StreamBounds, seconds: float) -> str:
    """One wait for a message that takes ``seconds``: ``"message"`` or the bound that tripped."""
    bounds.waiting()
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        if not bounds.expired_here():
            raise
        assert bounds.expired is not None
        return bounds.expired
    finally:
        bounds.done_waiting()
    return "message"


async def test_a_wait_longer_than_the_idle_bound_trips_it() -> None:
    bounds = StreamBounds(SHORT_S, LONG_S)
    try:
        assert await _wait(bounds, LONG_S) == "idle"
    finally:
        bounds.close()


async def test_the_whole_call_bound_trips_when_it_is_the_nearer() -> None:
    bounds = StreamBounds(LONG_S, SHORT_S)
    try:
        assert await _wait(bounds, LONG_S) == "deadline"
    finally:
        bounds.close()


async def test_time_between_waits_does_not_count_toward_the_idle_bound() -> None:
    # Messages come at once, but the consumer is slow (longer than the idle bound) between
    # them: only the waits on the engine are bounded.
    bounds = StreamBounds(SHORT_S, LONG_S)
    try:
        for _ in range(3):
            assert await _wait(bounds, 0) == "message"
            await asyncio.sleep(SHORT_S * 3)  # the armed timer fires here and must do nothing
        assert bounds.expired is None
        assert await _wait(bounds, LONG_S) == "idle"  # and it still guards the next wait
    finally:
        bounds.close()


async def test_a_cancellation_from_elsewhere_propagates() -> None:
    bounds = StreamBounds(LONG_S, LONG_S)
    task = asyncio.ensure_future(_wait(bounds, LONG_S))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert bounds.expired is None
    bounds.close()


async def test_each_wait_may_run_in_another_task() -> None:
    # A streamed response reads its first message in the request's task and the rest in the
    # response's: the timer cancels whichever task waits.
    bounds = StreamBounds(SHORT_S, LONG_S)
    try:
        assert await asyncio.ensure_future(_wait(bounds, 0)) == "message"
        assert await asyncio.ensure_future(_wait(bounds, LONG_S)) == "idle"
    finally:
        bounds.close()
