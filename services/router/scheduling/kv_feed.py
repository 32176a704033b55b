"""The router's subscriptions to its engines' KV events, feeding the :class:`KVIndex`.

A :class:`KVEventFeed` listens to the :class:`~services.router.scheduling.pool.EnginePool`:
every READY engine generation whose record names a ``kv_events_endpoint`` gets an
:class:`~services.kv_events.subscriber.EventSubscriber` and an empty index entry when it joins;
when it leaves (deregistered, not READY, or replaced by a new generation) its subscriber is
closed and its entries dropped. Each router process (each ``--workers`` worker, each replica)
subscribes on its own: the index needs no history of this router's routing, so every process
sees the same caches.

A subscriber's reports land here: batches go into the index; an incomplete stream marks the
engine stale in the index (load-only placement; counted per reason, logged once per episode);
a lost stream also drops its entries. Below: ``services.kv_events`` (wire, ZMQ); above: the
policy reads the index, never the feed.

*Silence.* A publisher that stops sending while its connection lives (its thread wedged, the
engine core no longer emitting) looks healthy to ZMQ: libzmq's I/O thread answers the ZMTP
heartbeats. The engine's load record says which batch it last handed its publisher
(``EngineLoad.kv_events_seq``, -1 unknown): when the subscription has not reached a reported
number within ``silence_s`` of the router first seeing it, the engine is stale with reason
``silent`` (entries kept, as for ``disconnected``), fresh again once the subscription reaches
it. :meth:`KVEventFeed.check_silence` applies the rule at a given time (a task calls it every
quarter of ``silence_s``; tests call it with their own clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import zmq.asyncio

from services.kv_events.events import EventBatch
from services.kv_events.subscriber import EventSubscriber
from services.router.metrics import RouterMetrics
from services.router.scheduling.closing import BackgroundCloses
from services.router.scheduling.kv_index import KVIndex
from services.router.scheduling.pool import EngineSlot

logger = logging.getLogger(__name__)

SILENCE_CHECKS = 4
"""Silence checks per ``silence_s`` (so an engine is marked at most a quarter late)."""
MIN_CHECK_S = 0.05


class _SlotSink:
    """One engine slot's :class:`~services.kv_events.subscriber.EventSink`, and its silence
    (module docstring): the engine is stale while the stream is incomplete (the subscriber's
    reports) or silent (:meth:`check_silence`), fresh when neither holds."""

    def __init__(self, feed: KVEventFeed, slot: EngineSlot) -> None:
        self._feed = feed
        self._slot = slot
        self._logged_stale = False
        self.last_seq = -1
        """The last sequence number applied."""
        self._incomplete = False
        self._silent = False
        self._awaited: int | None = None
        """A reported sequence number the subscription had not reached when first seen."""
        self._awaited_since = 0.0

    def apply(self, seq: int, batch: EventBatch) -> None:
        self.last_seq = max(self.last_seq, seq)
        self._feed.index.apply(self._slot, batch)
        self._feed.metrics.kv_events_received.inc()
        if self._awaited is not None and seq >= self._awaited:
            self._reached()
        self._feed.export()

    def dropped(self, reason: str) -> None:
        self._feed.metrics.kv_events_dropped.labels(reason=reason).inc()

    def check_silence(self, reached: int, now: float, silence_s: float) -> None:
        """Compare the load's reported sequence number with ``reached`` (the last one the
        subscription took) at ``now``; see the module docstring."""
        reported = self._slot.load.kv_events_seq
        if self._awaited is not None and (reached >= self._awaited or reported < 0):
            self._reached()
        if reported < 0 or reported <= reached:
            return
        if self._awaited is None:
            self._awaited, self._awaited_since = reported, now
        elif not self._silent and now - self._awaited_since >= silence_s:
            self._silent = True
            self._mark("silent", lost=False)

    def _reached(self) -> None:
        self._awaited = None
        if self._silent:
            self._silent = False
            if not self._incomplete:
                self._fresh()

    def stale(self, reason: str, *, lost: bool) -> None:
        self._incomplete = True
        self._mark(reason, lost=lost)

    def resumed(self) -> None:
        self._incomplete = False
        if not self._silent:
            self._fresh()

    def _mark(self, reason: str, *, lost: bool) -> None:
        index = self._feed.index
        was_stale = not index.tracks(self._slot)
        index.set_stale(self._slot, stale=True, lost=lost)
        if not was_stale:
            self._feed.metrics.kv_events_stale.labels(reason=reason).inc()
            if not self._logged_stale:
                self._logged_stale = True
                logger.warning(
                    "engine %s (generation %d): KV events %s (%s); placed by load only until "
                    "they resume (logged once per engine generation)",
                    self._slot.engine_id,
                    self._slot.record.generation,
                    reason,
                    "entries dropped" if lost else "entries kept",
                )
        self._feed.export()

    def _fresh(self) -> None:
        self._feed.index.set_stale(self._slot, stale=False)
        logger.info("engine %s: KV events resumed", self._slot.engine_id)
        self._feed.export()


class KVEventFeed:
    """Subscribes to every READY engine that publishes KV events; see the module docstring.
    A pool listener (``EnginePool.add_listener``); call :meth:`close` at shutdown."""

    def __init__(
        self,
        index: KVIndex,
        metrics: RouterMetrics,
        *,
        replay_timeout_s: float = 2.0,
        heartbeat_s: float = 5.0,
        silence_s: float = 6.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``silence_s``: how long a sequence number an engine reported may stay ahead of its
        subscription before the engine counts as silent; ``clock``: the time of the periodic
        silence checks."""
        self.index = index
        self.metrics = metrics
        self._replay_timeout_s = replay_timeout_s
        self._heartbeat_s = heartbeat_s
        self._silence_s = silence_s
        self._clock = clock
        self._sinks: dict[EngineSlot, _SlotSink] = {}
        self._watchdog: asyncio.Task[None] | None = None
        self._subscribers: dict[EngineSlot, EventSubscriber] = {}
        self._closing = BackgroundCloses("a departed engine's KV-event subscriber")
        self._context: zmq.asyncio.Context | None = None

    def joined(self, slot: EngineSlot) -> None:
        """``slot`` became READY: follow its events if it publishes any."""
        endpoint = slot.record.kv_events_endpoint
        if not endpoint or slot in self._sinks:
            return
        self.index.track(slot)
        sink = self._sinks[slot] = _SlotSink(self, slot)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # unit tests feeding the pool synchronously: index only
            return
        if self._context is None:
            self._context = zmq.asyncio.Context()
        if self._watchdog is None:
            self._watchdog = loop.create_task(self._watch_silence(), name="pdserve-kv-silence")
        subscriber = EventSubscriber(
            endpoint,
            slot.record.kv_events_replay_endpoint,
            sink,
            context=self._context,
            replay_timeout_s=self._replay_timeout_s,
            heartbeat_s=self._heartbeat_s,
        )
        self._subscribers[slot] = subscriber
        subscriber.start()
        logger.info("engine %s: following its KV events at %s", slot.engine_id, endpoint)

    def left(self, slot: EngineSlot) -> None:
        """``slot`` left the pool: stop following it and drop its entries."""
        self.index.forget(slot)
        self._sinks.pop(slot, None)
        subscriber = self._subscribers.pop(slot, None)
        if subscriber is not None:
            self._closing.start(subscriber.close())
        self.export()

    def subscriber(self, slot: EngineSlot) -> EventSubscriber | None:
        return self._subscribers.get(slot)

    def check_silence(self, now: float | None = None) -> None:
        """Mark silent, or fresh again, every followed engine by the sequence number its load
        last reported (module docstring), at ``now`` (default: the feed's clock)."""
        at = self._clock() if now is None else now
        for slot, sink in list(self._sinks.items()):
            reached = sink.last_seq
            subscriber = self._subscribers.get(slot)
            if subscriber is not None and subscriber.next_seq is not None:
                # Batches taken but not applied (undecodable, over the budget) count as reached.
                reached = max(reached, subscriber.next_seq - 1)
            sink.check_silence(reached, at, self._silence_s)

    async def _watch_silence(self) -> None:
        period = max(MIN_CHECK_S, self._silence_s / SILENCE_CHECKS)
        while True:
            await asyncio.sleep(period)
            try:
                self.check_silence()
            except Exception:  # a bug here must not end the checks
                logger.exception("KV-event silence check failed")

    def export(self) -> None:
        self.metrics.kv_index_blocks.set(len(self.index))
        self.metrics.kv_events_stale_engines.set(self.index.stale_count())

    async def close(self) -> None:
        if self._watchdog is not None:
            self._watchdog.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watchdog
            self._watchdog = None
        subscribers = list(self._subscribers.values())
        self._subscribers.clear()
        for subscriber in subscribers:
            await subscriber.close()
        await self._closing.wait()
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
