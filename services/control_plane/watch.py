"""Watching engine changes: pub/sub events plus full re-reads, since pub/sub is lossy.

:class:`EngineWatcher` keeps a snapshot of every live engine and yields an
:class:`EngineChange` whenever an engine appears, changes (generation, state, record, load) or
disappears. It re-reads everything when it starts, after every reconnect (messages sent while it
was away are lost) and every ``resync_interval_s`` (leases expire without any message); each
change a re-read finds says which (:attr:`EngineChange.resync`).

While Redis is unreachable the snapshot stays as last read (:attr:`EngineWatcher.unreachable_since`
says since when); one warning is logged when the connection is lost and one when it is back
(retries in between at debug level: an outage of minutes would otherwise log a line a backoff).

Use::

    async with control_plane.watch() as watcher:
        async for change in watcher:
            ...
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType
from typing import TYPE_CHECKING

from redis.asyncio.client import PubSub

from services.control_plane.base import AbstractEngineWatcher, EngineChange, EngineView
from services.control_plane.errors import ControlPlaneError, RecordDecodeError
from services.control_plane.wire import EngineId, EngineState, Event, EventKind, decode

if TYPE_CHECKING:
    from services.control_plane.redis_store import RedisControlPlane

logger = logging.getLogger(__name__)

_MAX_BATCH = 512
"""Most engines re-read in one round trip after a burst of events."""


class EngineWatcher(AbstractEngineWatcher):
    """The :class:`AbstractEngineWatcher` of :class:`RedisControlPlane`; see the module doc."""

    def __init__(
        self, control_plane: RedisControlPlane, *, handshake_progress: bool = False
    ) -> None:
        """``handshake_progress``: also report ranks' publications (an :class:`EngineChange`
        whose views may be equal; a burst is reported once), for displays of a grid filling
        up. Off by default: a handshake alone never changes an :class:`EngineView`, so readers
        that only need the verdict skip those events (16 per 16-rank engine)."""
        self._cp = control_plane
        self._handshake_progress = handshake_progress
        self._interval = control_plane.settings.resync_interval_s
        self._snapshot: dict[EngineId, EngineView] = {}
        self._changes: asyncio.Queue[EngineChange] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._synced = asyncio.Event()
        self._live = False
        """Subscribed and re-read since the last lost connection (the snapshot follows Redis)."""
        self._lost_at: float | None = None
        """When the connection was lost (``time.monotonic()``), until the next full re-read."""
        self._reconnected_at: float | None = None

    @property
    def snapshot(self) -> dict[EngineId, EngineView]:
        """The latest view of every live engine."""
        return dict(self._snapshot)

    def view(self, engine_id: EngineId) -> EngineView | None:
        """The latest view of ``engine_id`` (no copy of the snapshot), ``None`` if not live."""
        return self._snapshot.get(engine_id)

    @property
    def live(self) -> bool:
        """True while subscribed and re-read since the last lost connection: the snapshot
        then trails Redis by the events in flight (and by at most ``resync_interval_s`` for
        leases that expire without an event); while reconnecting it may be older."""
        return self._live

    @property
    def unreachable_since(self) -> float | None:
        return self._lost_at

    @property
    def reconnected_at(self) -> float | None:
        return self._reconnected_at

    async def __aenter__(self) -> EngineWatcher:
        self._task = asyncio.create_task(self._run(), name="pdserve-engine-watcher")
        await self._synced.wait()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def __anext__(self) -> EngineChange:
        if self._task is not None and self._task.done():
            raise StopAsyncIteration
        return await self._changes.get()

    async def next_change(self, within_s: float) -> EngineChange:
        """The next change, or :class:`TimeoutError` after ``within_s`` seconds."""
        return await asyncio.wait_for(self._changes.get(), within_s)

    async def _run(self) -> None:
        cause = "start"
        backoff = self._cp.settings.redis.retry_backoff_s
        while True:
            pubsub = self._cp.connection.client.pubsub()
            try:
                await pubsub.subscribe(self._cp.keys.events)
                await self._resync(cause)
                self._live = True
                self._synced.set()
                self._reached_again()
                backoff = self._cp.settings.redis.retry_backoff_s
                await self._listen(pubsub)
            except asyncio.CancelledError:
                raise
            except (ControlPlaneError, OSError, ConnectionError) as exc:
                self._lost(exc, backoff)
            except Exception as exc:  # redis-py raises its own ConnectionError subclasses here
                if "redis" not in type(exc).__module__:
                    raise
                self._lost(exc, backoff)
            finally:
                self._live = False
                with contextlib.suppress(Exception):
                    await pubsub.aclose()  # type: ignore[no-untyped-call]
            cause = "reconnect"
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self._cp.settings.redis.retry_backoff_max_s)

    def _lost(self, exc: Exception, backoff: float) -> None:
        if self._lost_at is None:
            self._lost_at = time.monotonic()
            logger.warning(
                "engine watcher lost Redis (%s): keeping the last snapshot of %d engines while "
                "reconnecting (first retry in %.2fs)",
                exc,
                len(self._snapshot),
                backoff,
            )
        else:
            logger.debug(
                "engine watcher: Redis still unreachable (%s); retry in %.2fs", exc, backoff
            )

    def _reached_again(self) -> None:
        if self._lost_at is None:
            return
        self._reconnected_at = time.monotonic()
        logger.warning(
            "engine watcher reached Redis again after %.1fs and re-read it: %d engines",
            self._reconnected_at - self._lost_at,
            len(self._snapshot),
        )
        self._lost_at = None

    async def _listen(self, pubsub: PubSub) -> None:
        last_resync = time.monotonic()
        task = asyncio.current_task()
        while True:
            message = await pubsub.get_message(
                ignore_subscribe_messages=True, timeout=self._interval
            )
            # redis-py's read timeout can swallow a cancellation that lands as it expires
            # (get_message then returns None); without this check the watcher never stopped and
            # the router's shutdown hung now and then.
            if task is not None and task.cancelling():
                raise asyncio.CancelledError
            changed: set[EngineId] = set()
            progressed: set[EngineId] = set()
            # Drain what is already queued and re-read each engine once, in one round trip.
            while message is not None and len(changed) < _MAX_BATCH:
                if message.get("type") == "message":
                    event = self._event_of(message["data"])
                    if event is None:
                        pass
                    elif event.kind is not EventKind.HANDSHAKE:
                        changed.add(event.engine_id)
                    elif self._handshake_progress:
                        progressed.add(event.engine_id)
                message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=0)
            if changed or progressed:
                views = await self._cp.get_engines(sorted(changed | progressed))
                for engine_id, view in views.items():
                    self._update(engine_id, view, force=engine_id in progressed)
            if time.monotonic() - last_resync >= self._interval:
                await self._resync("periodic")
                last_resync = time.monotonic()

    def _event_of(self, data: bytes) -> Event | None:
        try:
            return decode(data, Event)
        except RecordDecodeError as exc:
            self._cp.metrics.records_rejected.labels(reason=exc.reason).inc()
            logger.warning("ignored malformed control-plane event: %s", exc)
            return None

    async def _resync(self, cause: str) -> None:
        self._cp.metrics.watch_resyncs.labels(cause=cause).inc()
        views = {view.engine_id: view for view in await self._cp.list_engines()}
        for engine_id in set(self._snapshot) - set(views):
            self._update(engine_id, None, resync=cause)
        for engine_id, view in views.items():
            self._update(engine_id, view, resync=cause)

    def _update(
        self,
        engine_id: EngineId,
        view: EngineView | None,
        *,
        force: bool = False,
        resync: str | None = None,
    ) -> None:
        before = self._snapshot.get(engine_id)
        if before == view and not force:
            return
        if view is None:
            self._snapshot.pop(engine_id, None)
        else:
            self._snapshot[engine_id] = view
        gauge = self._cp.metrics.engine_state
        for state in EngineState:
            current = view is not None and view.state is state
            if view is None:
                with contextlib.suppress(KeyError):
                    gauge.remove(engine_id, state.value)
            else:
                gauge.labels(engine=engine_id, state=state.value).set(1 if current else 0)
        self._changes.put_nowait(EngineChange(engine_id, before, view, resync))
