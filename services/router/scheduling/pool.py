"""The router's live set of READY engines, followed through the control plane's watcher.

:class:`EnginePool` holds one :class:`EngineSlot` per READY engine generation: its record, the
load it last reported and this router's in-flight reservations on it. It is fed by
:meth:`EnginePool.follow` (an :class:`~services.control_plane.watch.EngineWatcher`: pub/sub plus
re-reads, no polling per request); unit tests feed :meth:`EnginePool.update` directly.

An engine that stops being READY (new generation, lease expired, deregistered, INVALID) leaves
the pool at once; its connector is closed when the last request using it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from services.control_plane.base import ControlPlane, EngineView
from services.control_plane.wire import EngineId, EngineLoad, EngineRecord, EngineRole
from services.router.metrics import RouterMetrics
from services.router.scheduling.connector import ConnectorFactory, EngineConnector
from services.router.scheduling.health import CircuitBreaker, CircuitState

logger = logging.getLogger(__name__)

_LOAD_KINDS = ("queue_depth", "running_requests", "kv_blocks_free", "kv_blocks_total")
_FOLLOW_RETRY_S = 1.0


@dataclass(eq=False)
class EngineSlot:
    """One READY engine generation as the router sees it."""

    record: EngineRecord
    connector: EngineConnector
    load: EngineLoad
    inflight: int = 0
    """Requests this router has sent and not finished (its reservations)."""
    retired: bool = False
    """No longer READY: chosen by nobody, closed when ``inflight`` drops to 0."""
    health: CircuitBreaker = field(default_factory=CircuitBreaker)
    """This router's circuit breaker on the engine (``services.router.scheduling.health``)."""

    @property
    def engine_id(self) -> EngineId:
        return self.record.engine_id

    @property
    def role(self) -> EngineRole:
        return self.record.role

    def compatible_with(self, other: EngineSlot) -> bool:
        """Whether KV can move between the two engines: same model, hash and block size."""
        return (
            self.record.model == other.record.model
            and self.record.compat_hash == other.record.compat_hash
            and self.record.block_size == other.record.block_size
        )


class PoolListener(Protocol):
    """Told when an engine slot joins or leaves the pool (the KV-event feed,
    ``services.router.scheduling.kv_feed``). Called synchronously from :meth:`EnginePool.update`."""

    def joined(self, slot: EngineSlot) -> None: ...

    def left(self, slot: EngineSlot) -> None: ...


class EnginePool:
    """READY engines by id; see the module docstring."""

    def __init__(
        self,
        connectors: ConnectorFactory,
        metrics: RouterMetrics,
        breaker: Callable[[], CircuitBreaker] = CircuitBreaker,
    ) -> None:
        self._connectors = connectors
        self._metrics = metrics
        self._breaker = breaker
        self._slots: dict[EngineId, EngineSlot] = {}
        self._ordered: dict[frozenset[EngineRole] | None, tuple[EngineSlot, ...]] = {}
        """:meth:`slots`' answers; cleared whenever ``_slots`` changes."""
        self._registered_models: dict[EngineId, str] = {}
        self._synced = asyncio.Event()
        self._closers: set[asyncio.Task[None]] = set()
        self._listeners: list[PoolListener] = []
        metrics.engine_inflight.read_from(self._inflight_samples)
        metrics.circuit_state.read_from(self._circuit_samples)

    # -- reading ------------------------------------------------------------------------------

    def slots(self, roles: Collection[EngineRole] | None = None) -> tuple[EngineSlot, ...]:
        """READY engines, optionally of some roles, in a stable order (by engine id). Kept per
        ``roles`` until the pool changes: the request path asks three times per request."""
        key = None if roles is None else frozenset(roles)
        ordered = self._ordered.get(key)
        if ordered is None:
            ordered = self._ordered[key] = tuple(
                slot for _, slot in sorted(self._slots.items()) if key is None or slot.role in key
            )
        return ordered

    def get(self, engine_id: EngineId) -> EngineSlot | None:
        return self._slots.get(engine_id)

    def ready_models(self) -> list[str]:
        """Models some READY engine serves."""
        return sorted({slot.record.model for slot in self._slots.values()})

    def registered_models(self) -> set[str]:
        """Models of every registered engine, READY or not."""
        return set(self._registered_models.values())

    @property
    def synced(self) -> bool:
        """True once the first full read of the control plane was applied."""
        return self._synced.is_set()

    def add_listener(self, listener: PoolListener) -> None:
        """Tell ``listener`` of every slot that joins or leaves from now on, and of the slots
        already in the pool."""
        self._listeners.append(listener)
        for slot in list(self._slots.values()):
            listener.joined(slot)

    # -- reservations ---------------------------------------------------------------------------

    def reserve(self, slot: EngineSlot) -> Reservation:
        """Count a request in flight on ``slot`` for the duration of a ``with`` block."""
        return Reservation(self, slot)

    def _released(self, slot: EngineSlot) -> None:
        slot.inflight -= 1
        if slot.retired and slot.inflight == 0:
            self._close_later(slot.connector)

    # -- health feedback (services.router.scheduling.health) --------------------------------

    def call_started(self, slot: EngineSlot) -> None:
        """Right before a call on ``slot``: the first one after a breaker's back-off probes."""
        slot.health.begin_call()

    def call_succeeded(self, slot: EngineSlot) -> None:
        slot.health.success()

    def call_failed(self, slot: EngineSlot) -> None:
        """A call failed through the engine's fault: the router stops choosing it at once."""
        if slot.health.failure():
            self._metrics.circuit_trips.labels(engine=slot.engine_id, role=slot.role.value).inc()
            logger.warning(
                "engine %s: circuit opened (a call failed); next probe in %.1f s",
                slot.engine_id,
                slot.health.retry_in_s,
            )

    def _circuit_samples(self) -> list[tuple[str, str, CircuitState]]:
        return [(s.engine_id, s.role.value, s.health.state) for s in list(self._slots.values())]

    def _inflight_samples(self) -> list[tuple[str, str, int]]:
        """``pdserve_router_engine_inflight``, read when scraped (READY engines only)."""
        return [(s.engine_id, s.role.value, s.inflight) for s in list(self._slots.values())]

    # -- following the control plane ------------------------------------------------------------

    def update(self, engine_id: EngineId, view: EngineView | None) -> None:
        """Apply the latest view of one engine (``None`` when it is gone)."""
        if view is not None and view.record is not None:
            self._registered_models[engine_id] = view.record.model
        else:
            self._registered_models.pop(engine_id, None)
        current = self._slots.get(engine_id)
        if view is None or view.record is None or not view.ready:
            if current is not None:
                self._remove(current)
            return
        record = view.record
        load = view.load or EngineLoad()
        if current is not None and current.record == record:
            current.load = load
        else:
            if current is not None:
                self._remove(current)
            current = EngineSlot(
                record, self._connectors.connect(record), load, health=self._breaker()
            )
            self._slots[engine_id] = current
            self._ordered.clear()
            logger.info(
                "engine %s (%s, generation %d) joined at %s",
                engine_id,
                record.role.value,
                record.generation,
                record.endpoint,
            )
            for listener in self._listeners:
                listener.joined(current)
        self._export_load(current)
        self._export_ready()

    def _remove(self, slot: EngineSlot) -> None:
        del self._slots[slot.engine_id]
        self._ordered.clear()
        slot.retired = True
        logger.info("engine %s left the pool", slot.engine_id)
        for listener in self._listeners:
            listener.left(slot)
        role = slot.role.value
        for kind in _LOAD_KINDS:
            with contextlib.suppress(KeyError):
                self._metrics.engine_load.remove(slot.engine_id, role, kind)
        if slot.inflight == 0:
            self._close_later(slot.connector)
        self._export_ready()

    def _export_load(self, slot: EngineSlot) -> None:
        gauge = self._metrics.engine_load
        labels = {"engine": slot.engine_id, "role": slot.role.value}
        for kind in _LOAD_KINDS:
            gauge.labels(**labels, kind=kind).set(getattr(slot.load, kind))

    def _export_ready(self) -> None:
        for role in EngineRole:
            count = sum(1 for slot in self._slots.values() if slot.role is role)
            self._metrics.ready_engines.labels(role=role.value).set(count)

    def _close_later(self, connector: EngineConnector) -> None:
        try:
            task = asyncio.get_running_loop().create_task(connector.close())
        except RuntimeError:  # no loop (unit tests feeding update() synchronously)
            return
        self._closers.add(task)
        task.add_done_callback(self._closers.discard)

    async def follow(self, control_plane: ControlPlane) -> None:
        """Apply every change the control plane's watcher reports, until cancelled.

        The watcher re-reads everything on start and after every reconnect; if it stops
        (Redis gone for longer than its retries), it is restarted after a pause, and the pool
        keeps its last view meanwhile (logged).
        """
        self._export_ready()
        while True:
            try:
                async with control_plane.watch() as watcher:
                    for engine_id, view in watcher.snapshot.items():
                        self.update(engine_id, view)
                    for engine_id in set(self._registered_models) - set(watcher.snapshot):
                        self.update(engine_id, None)
                    self._synced.set()
                    async for change in watcher:
                        self.update(change.engine_id, change.after)
            except asyncio.CancelledError:
                raise
            except Exception:
                logger.exception("control-plane watcher failed; restarting it")
            await asyncio.sleep(_FOLLOW_RETRY_S)

    async def close(self) -> None:
        """Close every connector."""
        slots = list(self._slots.values())
        self._slots.clear()
        self._ordered.clear()
        for slot in slots:
            with contextlib.suppress(Exception):
                await slot.connector.close()
        if self._closers:
            await asyncio.gather(*self._closers, return_exceptions=True)


class Reservation:
    """A request in flight on an engine slot (:meth:`EnginePool.reserve`): ``inflight`` counts
    it from ``__enter__`` to ``__exit__``, and a retired slot's connector closes when its last
    reservation ends. A class, not a ``contextlib`` generator: two per request."""

    __slots__ = ("_pool", "_slot")

    def __init__(self, pool: EnginePool, slot: EngineSlot) -> None:
        self._pool = pool
        self._slot = slot

    def __enter__(self) -> EngineSlot:
        self._slot.inflight += 1
        return self._slot

    def __exit__(self, *exc_info: object) -> None:
        self._pool._released(self._slot)
