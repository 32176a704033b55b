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
"""

from __future__ import annotations

import asyncio
import logging

import zmq.asyncio

from services.kv_events.events import EventBatch
from services.kv_events.subscriber import EventSubscriber
from services.router.metrics import RouterMetrics
from services.router.scheduling.kv_index import KVIndex
from services.router.scheduling.pool import EngineSlot

logger = logging.getLogger(__name__)


class _SlotSink:
    """One engine slot's :class:`~services.kv_events.subscriber.EventSink`."""

    def __init__(self, feed: KVEventFeed, slot: EngineSlot) -> None:
        self._feed = feed
        self._slot = slot
        self._logged_stale = False

    def apply(self, seq: int, batch: EventBatch) -> None:
        self._feed.index.apply(self._slot, batch)
        self._feed.metrics.kv_events_received.inc()
        self._feed.export()

    def dropped(self, reason: str) -> None:
        self._feed.metrics.kv_events_dropped.labels(reason=reason).inc()

    def stale(self, reason: str, *, lost: bool) -> None:
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

    def resumed(self) -> None:
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
    ) -> None:
        self.index = index
        self.metrics = metrics
        self._replay_timeout_s = replay_timeout_s
        self._heartbeat_s = heartbeat_s
        self._subscribers: dict[EngineSlot, EventSubscriber] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._context: zmq.asyncio.Context | None = None

    def joined(self, slot: EngineSlot) -> None:
        """``slot`` became READY: follow its events if it publishes any."""
        endpoint = slot.record.kv_events_endpoint
        if not endpoint or slot in self._subscribers:
            return
        self.index.track(slot)
        try:
            asyncio.get_running_loop()
        except RuntimeError:  # unit tests feeding the pool synchronously: index only
            return
        if self._context is None:
            self._context = zmq.asyncio.Context()
        subscriber = EventSubscriber(
            endpoint,
            slot.record.kv_events_replay_endpoint,
            _SlotSink(self, slot),
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
        subscriber = self._subscribers.pop(slot, None)
        if subscriber is not None:
            task = asyncio.get_running_loop().create_task(subscriber.close())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        self.export()

    def subscriber(self, slot: EngineSlot) -> EventSubscriber | None:
        return self._subscribers.get(slot)

    def export(self) -> None:
        self.metrics.kv_index_blocks.set(len(self.index))
        self.metrics.kv_events_stale_engines.set(self.index.stale_count())

    async def close(self) -> None:
        subscribers = list(self._subscribers.values())
        self._subscribers.clear()
        for subscriber in subscribers:
            await subscriber.close()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None
