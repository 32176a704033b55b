"""A publisher that stops sending while its sockets live: the reference engine's
:class:`~services.kv_events.publisher.KVEventPublisher` with its thread wedged in a send. ZMQ
keeps the connection up (libzmq's I/O thread answers the ZMTP heartbeats), so only the load
record's sequence number shows the router its events stopped: the engine goes stale as
``silent`` (entries kept) and fresh once the wedged batch arrives. The silence rule's time is
driven explicitly (``check_silence(now)``); the wall clock only waits for sockets."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from services.control_plane.wire import EngineLoad, EngineRole
from services.kv_events.events import BlockStored, EventBatch
from services.kv_events.publisher import KVEventPublisher
from tests.integration.kv_events.harness import wait_until
from tests.unit.router.fakes import runtime, sample, view

pytestmark = pytest.mark.integration

SILENCE_S = 3600.0  # the feed's own checks never run during the test: it drives the time
HEARTBEAT_S = 0.1


def stored(i: int) -> BlockStored:
    return BlockStored((1000 + i,), None, (i,) * 4, 4)


async def test_a_wedged_publisher_with_its_connection_alive_is_silent_then_fresh() -> None:
    publisher = KVEventPublisher(bind_host="127.0.0.1")
    rt = runtime(
        policy="prefix_aware",
        kv_events_silence_s=SILENCE_S,
        kv_events_heartbeat_s=HEARTBEAT_S,
    )

    def report(seq: int) -> None:
        rt.pool.update(
            "p",
            view(
                "p",
                EngineRole.PREFILL,
                load=EngineLoad(kv_events_seq=seq),
                kv_events_endpoint=publisher.endpoints.events,
                kv_events_replay_endpoint=publisher.endpoints.replay,
            ),
        )

    try:
        report(-1)
        feed = rt.kv_events
        slot = rt.pool.get("p")
        assert feed is not None and slot is not None
        index = feed.index
        publisher.publish([stored(0)])
        await wait_until(lambda: index.blocks_of(slot) == 1, "the first batch")

        # Wedge the publisher thread in its next send; its sockets stay open.
        release = threading.Event()
        send: Callable[..., None] = publisher._send  # type: ignore[assignment]

        def wedged(seq: int, batch: EventBatch) -> None:
            release.wait()
            send(seq, batch)

        publisher._send = wedged  # type: ignore[method-assign]
        publisher.publish([stored(1)])
        report(publisher.next_seq - 1)  # the heartbeat names batch 1
        # Several heartbeat timeouts pass: the connection is not dropped (hence the rule).
        await asyncio.sleep(10 * HEARTBEAT_S)
        assert sample(rt, "pdserve_router_kv_events_stale_total", reason="disconnected") == 0
        assert index.tracks(slot)

        feed.check_silence(0.0)
        feed.check_silence(SILENCE_S)
        assert not index.tracks(slot)
        assert sample(rt, "pdserve_router_kv_events_stale_total", reason="silent") == 1
        assert index.blocks_of(slot) == 1  # kept

        release.set()  # the batch goes out: fresh, with both blocks
        await wait_until(lambda: index.tracks(slot), "fresh again")
        assert index.blocks_of(slot) == 2
        assert sample(rt, "pdserve_router_kv_events_stale_engines") == 0
    finally:
        await rt.close()
        await asyncio.to_thread(publisher.close)
