"""``ProducerViews``: producer checks ride out a short control-plane outage on remembered views,
counted, bounded in age, without paying the Redis retry budget on every request; errors that
are not an outage (auth, a rejected command) are never masked.

The control plane is a fake here (ProducerViews is a state machine over ``get_engine``); the
outage against a real Redis and real engines is scenario 7 of tests/e2e/test_faults_reference.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import cast

import pytest

from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import ControlPlane, ControlPlaneError, ControlPlaneUnavailable
from services.control_plane.base import EngineView
from services.control_plane.wire import EngineRecord, EngineRole, EngineState, EngineStatus
from services.engines.errors import ProducerUnavailable
from services.engines.producer_check import (
    ProducerViews,
    Refusal,
    producer_check_settings,
)
from services.engines.requests import KVHandle
from services.topology import ModelShape

HANDLE = KVHandle("prefill-a", 3, "req-1", (0, 1), 8, 2e9)
MAX_STALE_S = 30.0
RETRY_AFTER_S = 1.0


def view(generation: int = 3, state: EngineState = EngineState.READY) -> EngineView:
    record = EngineRecord(
        "prefill-a",
        generation,
        EngineRole.PREFILL,
        "m",
        "c0",
        ModelShape(num_layers=7, num_kv_heads=2, block_size=4),
        "h:1",
        True,
        1,
        0,
    )
    return EngineView(
        "prefill-a", record, EngineStatus("prefill-a", generation, state, (), 1, 0), None
    )


class FakeControlPlane:
    """``get_engine`` answers ``answer`` (a view, ``None``, or an error to raise); counts reads."""

    def __init__(self) -> None:
        self.answer: EngineView | None | Exception = view()
        self.reads = 0

    async def get_engine(self, engine_id: str) -> EngineView | None:
        self.reads += 1
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    def __init__(self, max_stale_s: float = MAX_STALE_S) -> None:
        self.plane = FakeControlPlane()
        self.clock = Clock()
        self.fallbacks: list[str] = []
        self.views = ProducerViews(
            cast(ControlPlane, self.plane),
            max_stale_s=max_stale_s,
            retry_after_s=RETRY_AFTER_S,
            on_fallback=self.fallbacks.append,
            clock=self.clock,
        )

    async def check(self) -> Refusal | None:
        return await self.views.refusal(HANDLE, compat_hash="c0", block_size=4)


def outage() -> ControlPlaneUnavailable:
    return ControlPlaneUnavailable("Redis unreachable while trying to get_engines: refused")


def assert_control_plane_refusal(refusal: Refusal | None) -> None:
    assert refusal is not None
    assert (refusal.error, refusal.reason) == (ProducerUnavailable, "control_plane")
    error = refusal.exception()
    assert isinstance(error, ProducerUnavailable) and "prefill-a" in str(error)
    assert isinstance(error.__cause__, ControlPlaneError)


async def test_a_remembered_ready_view_answers_during_an_outage_and_is_counted() -> None:
    harness = Harness()
    assert await harness.check() is None
    assert harness.fallbacks == []
    harness.plane.answer = outage()
    harness.clock.now += 5
    assert await harness.check() is None
    assert harness.fallbacks == ["last_known"]


async def test_a_remembered_view_is_still_checked_like_a_fresh_one() -> None:
    harness = Harness()
    harness.plane.answer = view(state=EngineState.PENDING)
    refusal = await harness.check()
    assert refusal is not None and refusal.reason == "not_ready"
    harness.plane.answer = outage()
    refusal = await harness.check()
    assert refusal is not None and refusal.reason == "not_ready"
    assert harness.fallbacks == ["last_known"]


async def test_a_view_older_than_max_stale_is_refused_and_counted() -> None:
    harness = Harness()
    assert await harness.check() is None
    harness.plane.answer = outage()
    harness.clock.now += MAX_STALE_S + 0.1
    assert_control_plane_refusal(await harness.check())
    assert harness.fallbacks == ["refused"]


async def test_without_a_remembered_view_an_outage_refuses() -> None:
    harness = Harness()
    harness.plane.answer = outage()
    assert_control_plane_refusal(await harness.check())
    assert harness.fallbacks == ["refused"]


async def test_a_producer_read_as_unregistered_is_forgotten() -> None:
    harness = Harness()
    assert await harness.check() is None
    harness.plane.answer = None
    refusal = await harness.check()
    assert refusal is not None and refusal.reason == "gone"
    assert harness.views.remembered("prefill-a") is None
    harness.plane.answer = outage()
    assert_control_plane_refusal(await harness.check())


async def test_within_retry_after_reads_skip_the_control_plane_and_retry_after() -> None:
    harness = Harness()
    assert await harness.check() is None
    harness.plane.answer = outage()
    assert await harness.check() is None
    assert harness.plane.reads == 2
    for _ in range(5):
        harness.clock.now += RETRY_AFTER_S / 10
        assert await harness.check() is None
    assert harness.plane.reads == 2, "reads within retry_after_s must not ask the control plane"
    assert harness.fallbacks == ["last_known"] * 6
    harness.clock.now += RETRY_AFTER_S
    harness.plane.answer = view()
    assert await harness.check() is None
    assert harness.plane.reads == 3
    # Back to normal: every check reads again and nothing more is counted as a fallback.
    assert await harness.check() is None
    assert harness.plane.reads == 4
    assert harness.fallbacks == ["last_known"] * 6


async def test_the_view_read_after_an_outage_replaces_the_remembered_one() -> None:
    harness = Harness()
    assert await harness.check() is None
    harness.plane.answer = outage()
    assert await harness.check() is None
    harness.clock.now += RETRY_AFTER_S
    harness.plane.answer = view(generation=4)  # the producer re-registered
    refusal = await harness.check()
    assert refusal is not None and refusal.reason == "stale_generation"
    harness.plane.answer = outage()
    harness.clock.now += RETRY_AFTER_S
    refusal = await harness.check()
    assert refusal is not None and refusal.reason == "stale_generation"
    assert harness.fallbacks == ["last_known", "last_known"]


@pytest.mark.parametrize(
    "error",
    [
        ControlPlaneUnavailable("Redis refused the credentials", reason="auth"),
        ControlPlaneError("Redis rejected a command"),
    ],
    ids=["auth", "rejected_command"],
)
async def test_errors_that_are_not_an_outage_are_never_masked(error: ControlPlaneError) -> None:
    harness = Harness()
    assert await harness.check() is None
    harness.plane.answer = error
    assert_control_plane_refusal(await harness.check())
    assert harness.fallbacks == []
    # No fast path either: the next check asks the control plane again.
    assert_control_plane_refusal(await harness.check())
    assert harness.plane.reads == 3


async def test_max_stale_zero_turns_the_fallback_off() -> None:
    plane = FakeControlPlane()
    views = ProducerViews(cast(ControlPlane, plane), max_stale_s=0.0, retry_after_s=0.0)
    assert await views.refusal(HANDLE, compat_hash="c0") is None
    plane.answer = outage()
    refusal = await views.refusal(HANDLE, compat_hash="c0")
    assert refusal is not None and refusal.reason == "control_plane"
    assert plane.reads == 2


async def test_the_remembered_map_is_bounded() -> None:
    plane = FakeControlPlane()
    clock = Clock()
    views = ProducerViews(
        cast(ControlPlane, plane),
        max_stale_s=MAX_STALE_S,
        on_fallback=lambda outcome: None,
        max_entries=2,
        clock=clock,
    )
    for producer in ("p-1", "p-2", "p-3"):
        handle = KVHandle(producer, 3, "req", (0, 1), 8, 2e9)
        await views.refusal(handle, compat_hash="c0")
        clock.now += 1
    assert views.remembered("p-1") is None
    assert views.remembered("p-2") is not None and views.remembered("p-3") is not None
    # Entries older than max_stale_s go at the next read, whatever the count.
    clock.now += MAX_STALE_S
    await views.refusal(KVHandle("p-4", 3, "req", (0, 1), 8, 2e9), compat_hash="c0")
    assert views.remembered("p-2") is None and views.remembered("p-3") is None


def test_a_fallback_must_be_counted() -> None:
    with pytest.raises(ValueError, match="counted"):
        ProducerViews(cast(ControlPlane, FakeControlPlane()), max_stale_s=1.0)


def test_producer_check_reads_use_a_short_retry_budget() -> None:
    settings = ControlPlaneSettings(redis=RedisSettings(retry_attempts=5), namespace="n1")
    short = producer_check_settings(settings)
    assert short.redis.retry_attempts == 1
    assert (short.namespace, short.redis.url) == ("n1", settings.redis.url)
    assert settings.redis.retry_attempts == 5
    none = ControlPlaneSettings(redis=RedisSettings(retry_attempts=0))
    assert producer_check_settings(none).redis.retry_attempts == 0


async def test_an_outage_is_logged_once_when_it_begins_and_once_when_it_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    harness = Harness()
    assert await harness.check() is None
    harness.plane.answer = outage()
    with caplog.at_level(logging.WARNING, logger="services.engines.producer_check"):
        for _ in range(20):
            harness.clock.now += RETRY_AFTER_S  # every check asks Redis again, and fails
            await harness.check()
        assert len(caplog.records) == 1
        assert "unavailable" in caplog.records[0].getMessage()
        harness.plane.answer = view()
        harness.clock.now += RETRY_AFTER_S
        await harness.check()
        await harness.check()
    assert len(caplog.records) == 2
    assert "available again" in caplog.records[1].getMessage()
    assert "20 checks were answered" in caplog.records[1].getMessage()


class FakeWatcher:
    """What :meth:`ProducerViews.follow` reads of an ``EngineWatcher``: ``live``, ``view``; it
    yields no change until the test ends it."""

    def __init__(self) -> None:
        self.live = True
        self.views: dict[str, EngineView] = {}
        self.ended = asyncio.Event()

    def view(self, engine_id: str) -> EngineView | None:
        return self.views.get(engine_id)

    async def __aenter__(self) -> FakeWatcher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def __aiter__(self) -> FakeWatcher:
        return self

    async def __anext__(self) -> None:
        await self.ended.wait()
        raise StopAsyncIteration


class WatchedPlane(FakeControlPlane):
    def __init__(self, watcher: FakeWatcher) -> None:
        super().__init__()
        self.watcher = watcher

    def watch(self) -> FakeWatcher:
        return self.watcher


async def test_a_followed_view_that_accepts_answers_without_a_read_and_refusals_read() -> None:
    harness = Harness()
    watcher = FakeWatcher()
    following = asyncio.create_task(harness.views.follow(cast(ControlPlane, WatchedPlane(watcher))))
    await asyncio.sleep(0)  # follow() enters the watcher
    # The watcher's READY view at the handle's generation: no read.
    watcher.views["prefill-a"] = view()
    assert await harness.check() is None
    assert harness.plane.reads == 0
    # The watcher lags (an older generation, or not READY yet): Redis decides.
    for lagging in (view(generation=2), view(state=EngineState.PENDING)):
        watcher.views["prefill-a"] = lagging
        reads = harness.plane.reads
        assert await harness.check() is None  # Redis says READY at generation 3
        assert harness.plane.reads == reads + 1
    # Redis refuses: refused, whatever the watcher said.
    harness.plane.answer = view(state=EngineState.INVALID)
    refusal = await harness.check()
    assert refusal is not None and refusal.reason == "not_ready"
    # A watcher that lost Redis is not used.
    watcher.views["prefill-a"] = view()
    watcher.live = False
    refusal = await harness.check()
    assert refusal is not None and refusal.reason == "not_ready"
    # Once the watcher ends, every check reads Redis again.
    watcher.live = True
    watcher.ended.set()
    await following
    reads = harness.plane.reads
    assert (await harness.check()) is not None
    assert harness.plane.reads == reads + 1
    assert harness.fallbacks == []


async def test_a_view_the_watcher_accepted_answers_an_outage_that_begins_after_it() -> None:
    """The watcher answers nearly every check, so its accepted views are remembered: before,
    an outage found no view and refused every handle from its first second."""
    harness = Harness()
    watcher = FakeWatcher()
    following = asyncio.create_task(harness.views.follow(cast(ControlPlane, WatchedPlane(watcher))))
    await asyncio.sleep(0)
    watcher.views["prefill-a"] = view()
    assert await harness.check() is None
    assert harness.plane.reads == 0
    # Redis goes away: the watcher is not live, the read fails, the accepted view answers.
    watcher.live = False
    harness.plane.answer = outage()
    harness.clock.now += 5
    assert await harness.check() is None
    assert harness.fallbacks == ["last_known"]
    watcher.ended.set()
    await following


async def test_a_view_fresh_when_the_outage_began_answers_however_long_it_lasts() -> None:
    """Nothing registers a new generation while Redis is down, so the bound is the view's age
    when the outage began (issue 49: pairings stopped after 30 s of any outage)."""
    harness = Harness()
    assert await harness.check() is None  # read at 1000
    harness.clock.now += MAX_STALE_S - 1
    harness.plane.answer = outage()
    assert await harness.check() is None  # the outage begins, the view 29 s old
    harness.clock.now += 10 * MAX_STALE_S
    assert await harness.check() is None
    assert harness.fallbacks == ["last_known", "last_known"]
    # Still checked like a fresh view: a handle of another generation is refused.
    other = KVHandle("prefill-a", 4, "req-2", (0, 1), 8, 2e9)
    refusal = await harness.views.refusal(other, compat_hash="c0", block_size=4)
    assert refusal is not None and refusal.reason != "control_plane"
    # A view already older than the bound when the outage began is refused.
    late = Harness()
    assert await late.check() is None
    late.clock.now += MAX_STALE_S + 1
    late.plane.answer = outage()
    assert_control_plane_refusal(await late.check())
    assert late.fallbacks == ["refused"]
