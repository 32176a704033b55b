"""The KV-event feed's silence rule: an engine whose load record names a batch the subscription
has not received within ``kv_events_silence_s`` is stale (``silent``), entries kept, and fresh
again once the batch arrives. Time is driven explicitly (``check_silence(now)``); no sockets."""

from __future__ import annotations

import logging

import pytest

from services.control_plane.base import EngineView
from services.control_plane.wire import EngineLoad, EngineRole
from services.kv_events.events import BlockStored, EventBatch
from services.router.runtime import RouterRuntime
from services.router.scheduling.kv_feed import KVEventFeed, _SlotSink
from tests.unit.router.fakes import runtime, sample, view

SILENCE_S = 3.0


def reporting(seq: int, *, generation: int = 1) -> EngineView:
    return view(
        "p",
        EngineRole.PREFILL,
        generation=generation,
        load=EngineLoad(queue_depth=1, kv_events_seq=seq),
        kv_events_endpoint="tcp://127.0.0.1:1",
        kv_events_replay_endpoint="tcp://127.0.0.1:2",
    )


def batch(i: int) -> EventBatch:
    return EventBatch(0.0, (BlockStored((1000 + i,), None, (i,) * 4, 4),))


@pytest.fixture
def rt() -> RouterRuntime:
    rt = runtime(policy="prefix_aware", kv_events_silence_s=SILENCE_S)
    rt.pool.update("p", reporting(-1))
    return rt


def feed_of(rt: RouterRuntime) -> KVEventFeed:
    assert rt.kv_events is not None
    return rt.kv_events


def sink_of(rt: RouterRuntime) -> _SlotSink:
    feed = feed_of(rt)
    slot = rt.pool.get("p")
    assert slot is not None
    return feed._sinks[slot]


def stale_count(rt: RouterRuntime, reason: str = "silent") -> float:
    return sample(rt, "pdserve_router_kv_events_stale_total", reason=reason)


def tracked(rt: RouterRuntime) -> bool:
    slot = rt.pool.get("p")
    assert slot is not None
    return feed_of(rt).index.tracks(slot)


def test_a_reported_batch_never_received_makes_the_engine_silent_then_fresh_when_it_comes(
    rt, caplog: pytest.LogCaptureFixture
) -> None:
    feed, sink, slot = feed_of(rt), sink_of(rt), rt.pool.get("p")
    sink.apply(0, batch(0))
    rt.pool.update("p", reporting(3))  # the engine published 1..3; none arrives
    assert rt.pool.get("p") is slot  # same generation: same slot, new load
    feed.check_silence(100.0)  # first seen behind
    feed.check_silence(100.0 + SILENCE_S - 0.01)
    assert tracked(rt) and stale_count(rt) == 0
    with caplog.at_level(logging.WARNING):
        feed.check_silence(100.0 + SILENCE_S)
        feed.check_silence(200.0)  # the same episode: counted and logged once
    assert not tracked(rt)
    assert stale_count(rt) == 1
    assert sample(rt, "pdserve_router_kv_events_stale_engines") == 1
    assert feed.index.blocks_of(slot) == 1  # entries kept, as for `disconnected`
    assert sum("silent" in r.getMessage() for r in caplog.records) == 1
    # The subscription catches up: fresh at once, entries still there.
    sink.apply(1, batch(1))
    assert not tracked(rt)  # 3 not reached yet
    sink.apply(3, batch(3))
    assert tracked(rt) and feed.index.blocks_of(slot) == 3
    assert sample(rt, "pdserve_router_kv_events_stale_engines") == 0


def test_a_stream_that_keeps_up_is_never_silent_however_busy() -> None:
    rt = runtime(policy="prefix_aware", kv_events_silence_s=SILENCE_S)
    rt.pool.update("p", reporting(-1))
    feed, sink = feed_of(rt), sink_of(rt)
    # Every check sees the engine a little ahead (the load outran the events), and every
    # reported batch arrives before the grace runs out.
    now = 0.0
    for seq in range(0, 200, 2):
        rt.pool.update("p", reporting(seq + 1))
        feed.check_silence(now)
        sink.apply(seq, batch(seq))
        sink.apply(seq + 1, batch(seq + 1))
        now += SILENCE_S * 0.9
        feed.check_silence(now)
    assert tracked(rt) and stale_count(rt) == 0


def test_an_engine_reaching_an_old_report_but_behind_a_new_one_gets_a_new_grace(rt) -> None:
    feed, sink = feed_of(rt), sink_of(rt)
    rt.pool.update("p", reporting(5))
    feed.check_silence(0.0)
    sink.apply(5, batch(5))
    rt.pool.update("p", reporting(9))
    feed.check_silence(SILENCE_S * 2)  # 9 first seen now
    assert tracked(rt)
    feed.check_silence(SILENCE_S * 3)
    assert not tracked(rt) and stale_count(rt) == 1


def test_unknown_sequence_numbers_never_make_an_engine_silent(rt) -> None:
    # vLLM engines (the host cannot see its publisher's number) and engines that predate the
    # field report -1.
    feed = feed_of(rt)
    for now in (0.0, SILENCE_S, 10 * SILENCE_S):
        feed.check_silence(now)
    assert tracked(rt) and stale_count(rt) == 0
    # An engine that turns to unknown while silent is no longer held silent.
    rt.pool.update("p", reporting(4))
    feed.check_silence(0.0)
    feed.check_silence(SILENCE_S)
    assert not tracked(rt)
    rt.pool.update("p", reporting(-1))
    feed.check_silence(SILENCE_S * 2)
    assert tracked(rt)


def test_silent_and_disconnected_each_hold_the_engine_stale_until_both_clear(rt) -> None:
    feed, sink = feed_of(rt), sink_of(rt)
    rt.pool.update("p", reporting(2))
    feed.check_silence(0.0)
    feed.check_silence(SILENCE_S)
    sink.stale("disconnected", lost=False)  # already stale: not counted again
    assert stale_count(rt) == 1 and stale_count(rt, "disconnected") == 0
    sink.resumed()  # reconnected, but the reported batch is still missing
    assert not tracked(rt)
    sink.stale("disconnected", lost=False)
    sink.apply(2, batch(2))  # silence over; still disconnected
    assert not tracked(rt)
    sink.resumed()
    assert tracked(rt)


def test_a_lost_stream_behind_the_report_drops_entries_and_stays_stale_until_it_catches_up(
    rt,
) -> None:
    feed, sink, slot = feed_of(rt), sink_of(rt), rt.pool.get("p")
    sink.apply(0, batch(0))
    rt.pool.update("p", reporting(6))
    feed.check_silence(0.0)
    feed.check_silence(SILENCE_S)
    sink.stale("gap", lost=True)
    assert feed.index.blocks_of(slot) == 0
    sink.apply(5, batch(5))
    sink.resumed()  # the subscriber resumes after its first batch past the gap
    assert not tracked(rt)  # 6 still missing
    feed.check_silence(SILENCE_S * 2)
    sink.apply(6, batch(6))
    assert tracked(rt)


def test_a_new_generation_starts_with_no_silence() -> None:
    rt = runtime(policy="prefix_aware", kv_events_silence_s=SILENCE_S)
    rt.pool.update("p", reporting(7))
    feed = feed_of(rt)
    feed.check_silence(0.0)
    feed.check_silence(SILENCE_S)
    assert not tracked(rt)
    rt.pool.update("p", reporting(0, generation=2))  # a restarted engine, numbers from 0
    feed.check_silence(SILENCE_S * 2)
    assert tracked(rt)
    sink_of(rt).apply(0, batch(0))
    feed.check_silence(SILENCE_S * 10)
    assert tracked(rt) and stale_count(rt) == 1


def test_the_grace_defaults_to_three_control_plane_heartbeats() -> None:
    rt = runtime(policy="prefix_aware", control_plane={"heartbeat_interval_s": 1.5})
    assert feed_of(rt)._silence_s == 4.5
