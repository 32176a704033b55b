"""The router's live set of READY engines, followed through the control plane's watcher.

:class:`EnginePool` holds one :class:`EngineSlot` per READY engine generation: its record, the
load it last reported and this router's in-flight reservations on it. It is fed by
:meth:`EnginePool.follow` (an :class:`~services.control_plane.watch.EngineWatcher`: pub/sub plus
re-reads, no polling per request); unit tests feed :meth:`EnginePool.update` directly.

An engine that stops being READY (new generation, lease expired, deregistered, INVALID) leaves
the pool at once; its connector is closed when the last request using it ends.

Control-plane outages (docs/router.md, "Through a control-plane outage"): while the watcher cannot
reach Redis, the pool keeps its last view (the engines serve on; the router's own calls and circuit
breakers say whether they answer). When Redis is back and a re-read (the one after the reconnect, or
a periodic one within ``holdover_s`` of it: a lease that ran out because the heartbeats had not
reached Redis yet, as after a Sentinel failover) no longer lists an engine READY (Redis restarted
empty, or from an old snapshot, and the engine has not registered again yet), or within
``holdover_s`` of the reconnect the engine registers again at a new generation (its heartbeat found
its lease gone before any re-read did), the engine is *held*: kept for choosing while its breaker
stays closed, until its new generation is READY (which replaces it), until a call on it fails (it
leaves at once), or for at most ``holdover_s``. Counted in
``pdserve_router_engine_holdovers_total``; ``pdserve_router_control_plane_unreachable_seconds`` says
how stale the view is.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

from services.control_plane.base import AbstractEngineWatcher, ControlPlane, EngineView
from services.control_plane.wire import EngineId, EngineLoad, EngineRecord, EngineRole
from services.router.metrics import RouterMetrics
from services.router.scheduling.closing import BackgroundCloses
from services.router.scheduling.connector import ConnectorFactory
from services.router.scheduling.health import CircuitBreaker, CircuitState
from services.serving.client.connector import EngineConnector

logger = logging.getLogger(__name__)

_LOAD_KINDS = ("queue_depth", "running_requests", "kv_blocks_free", "kv_blocks_total")
_FOLLOW_RETRY_S = 1.0
_EXPIRY_CHECK_S = 1.0
"""How often :meth:`EnginePool.follow` looks for held engines whose holdover ran out."""


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
    lora_unloads: set[str] = field(default_factory=set)
    """LoRA adapters this router unloaded from the engine that its load record still listed:
    their leaving is no eviction."""
    reported_adapters: frozenset[str] = frozenset()
    """The LoRA adapters the engine's last load record listed."""
    held_until: float | None = None
    """Held after an outage (see the module docstring): chosen until then
    (``time.monotonic()``) unless its new generation is READY or a call fails first."""

    engine_id: EngineId = field(init=False)
    """The record's (plain attributes: the request path reads them several times a call)."""
    role: EngineRole = field(init=False)

    def __post_init__(self) -> None:
        self.engine_id = self.record.engine_id
        self.role = self.record.role

    def compatible_with(self, other: EngineSlot) -> bool:
        """Whether KV can move between the two engines: same model, hash and block size."""
        return (
            self.record.model == other.record.model
            and self.record.compat_hash == other.record.compat_hash
            and self.record.shape.block_size == other.record.shape.block_size
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
        *,
        holdover_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``holdover_s``: the longest an engine is held after an outage (module docstring)."""
        self._connectors = connectors
        self._metrics = metrics
        self._breaker = breaker
        self._holdover_s = holdover_s
        self._clock = clock
        self._watcher: AbstractEngineWatcher | None = None
        """The control plane's watcher while :meth:`follow` runs (its staleness)."""
        self._following_since: float | None = None
        """When :meth:`follow` last failed to keep a watcher (``None``: it has one)."""
        self._reconnected_at: float | None = None
        """When the control plane was last re-read after an outage (``time.monotonic()``)."""
        self._slots: dict[EngineId, EngineSlot] = {}
        self._ordered: dict[frozenset[EngineRole] | None, tuple[EngineSlot, ...]] = {}
        """:meth:`slots`' answers; cleared whenever ``_slots`` changes."""
        self._registered_models: dict[EngineId, str] = {}
        self._synced = asyncio.Event()
        self._closers = BackgroundCloses("a departed engine's connector")
        self._listeners: list[PoolListener] = []
        metrics.engine_inflight.read_from(self._inflight_samples)
        metrics.circuit_state.read_from(
            self._circuit_samples, tuple(state.value for state in CircuitState)
        )
        metrics.control_plane_unreachable.set_function(self.control_plane_unreachable_s)

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

    def control_plane_unreachable_s(self) -> float:
        """Seconds since this router last followed the control plane (0 while it does): how
        stale the pool's view may be. Also ``pdserve_router_control_plane_unreachable_seconds``."""
        watcher = self._watcher
        since = watcher.unreachable_since if watcher is not None else self._following_since
        return 0.0 if since is None else max(self._clock() - since, 0.0)

    def held(self) -> list[EngineId]:
        """Engines held after an outage (see the module docstring)."""
        return sorted(s.engine_id for s in self._slots.values() if s.held_until is not None)

    def add_listener(self, listener: PoolListener) -> None:
        """Tell ``listener`` of every slot that joins or leaves from now on, and of the slots
        already in the pool."""
        self._listeners.append(listener)
        for slot in list(self._slots.values()):
            listener.joined(slot)

    # -- reservations ---------------------------------------------------------------------------

    def reserve(self, slot: EngineSlot) -> Reservation:
        """Count a request in flight on ``slot`` for the duration of a ``with`` block."""
        return Reservation(self, slot, call=False)

    def call(self, slot: EngineSlot) -> Reservation:
        """:meth:`reserve` ``slot`` for one call on the engine, which feeds its circuit breaker
        too: the call starts on entering (the first after the back-off is the half-open probe)
        and succeeds on leaving the ``with`` block without an error; a failure through the
        engine's fault is reported to :meth:`call_failed` (an error's code says whether it is
        one)."""
        return Reservation(self, slot, call=True)

    def _released(self, slot: EngineSlot) -> None:
        slot.inflight -= 1
        if slot.retired and slot.inflight == 0:
            self._close_later(slot.connector)

    # -- health feedback (services.router.scheduling.health) --------------------------------
    # A call starts and succeeds on the slot's breaker itself (a reserved call, :meth:`call`;
    # a Decode stream's leg: ``slot.health.begin_call()``, ``.success()``); a failure comes
    # here, where the pool's own state changes with it.

    def call_failed(self, slot: EngineSlot) -> None:
        """A call failed through the engine's fault: the router stops choosing it at once (a
        held engine leaves the pool; the breaker's trip is counted)."""
        if slot.held_until is not None and self._slots.get(slot.engine_id) is slot:
            self._release_held(slot, "failed")
        if slot.health.failure():
            self._metrics.circuit_trips.labels(engine=slot.engine_id, role=slot.role.value).inc()
            logger.warning(
                "engine %s: circuit opened (a call failed); next probe in %.1f s",
                slot.engine_id,
                slot.health.retry_in_s,
            )

    def _circuit_samples(self) -> list[tuple[str, str, str]]:
        return [
            (s.engine_id, s.role.value, s.health.state.value) for s in list(self._slots.values())
        ]

    def _inflight_samples(self) -> list[tuple[str, str, int]]:
        """``pdserve_router_engine_inflight``, read when scraped (READY engines only)."""
        return [(s.engine_id, s.role.value, s.inflight) for s in list(self._slots.values())]

    # -- following the control plane ------------------------------------------------------------

    def update(
        self, engine_id: EngineId, view: EngineView | None, *, resync: str | None = None
    ) -> None:
        """Apply the latest view of one engine (``None`` when it is gone); ``resync`` is the
        re-read that found it (:attr:`EngineChange.resync`), ``None`` for an event."""
        if resync == "reconnect":
            self._reconnected_at = self._clock()
        current = self._slots.get(engine_id)
        if view is None or view.record is None or not view.ready:
            if current is not None and self._holds(current, view, resync):
                return
            if view is not None and view.record is not None:
                self._registered_models[engine_id] = view.record.model
            else:
                self._registered_models.pop(engine_id, None)
            current = self._slots.get(engine_id)  # (an expired hold has left already)
            if current is not None:
                self._remove(current)
            return
        record = view.record
        self._registered_models[engine_id] = record.model
        load = view.load or EngineLoad()
        if current is not None and current.record == record:
            self._count_evictions(current, load)
            current.load = load
            if current.held_until is not None:  # Redis came back with its registration
                current.held_until = None
                self._metrics.holdovers.labels(outcome="confirmed").inc()
        else:
            if current is not None:
                if current.held_until is not None:
                    self._metrics.holdovers.labels(outcome="replaced").inc()
                self._remove(current)
            current = EngineSlot(
                record,
                self._connectors.connect(record),
                load,
                health=self._breaker(),
                reported_adapters=frozenset(load.lora_adapters),
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

    def _count_evictions(self, slot: EngineSlot, load: EngineLoad) -> None:
        """Count the adapters that left ``slot``'s load record without an unload through this
        router (its LRU made room: ``pdserve_router_lora_evictions_total``)."""
        now = frozenset(load.lora_adapters)
        gone, slot.reported_adapters = slot.reported_adapters - now, now
        if not gone:
            return
        evicted = gone - slot.lora_unloads
        slot.lora_unloads -= gone
        if evicted:
            self._metrics.lora_evictions.labels(role=slot.role.value).inc(len(evicted))

    def _holds(self, slot: EngineSlot, view: EngineView | None, resync: str | None) -> bool:
        """Whether ``slot``, which the control plane no longer lists READY, stays (held)."""
        if slot.held_until is not None:
            if self._clock() < slot.held_until:
                return True
            self._release_held(slot, "expired")
            return False
        # Within the holdover of a reconnect, a periodic re-read that misses the engine (its
        # lease ran out before its heartbeat reached Redis again) and the event of its
        # re-registration (the heartbeat found the lease gone first: a newer generation, not
        # READY yet) are the outage's doing; a deregistration event is not.
        reregistering = (
            view is not None
            and view.record is not None
            and view.record.generation != slot.record.generation
        )
        after_outage = resync == "reconnect" or (
            (resync is not None or reregistering)
            and self._reconnected_at is not None
            and self._clock() - self._reconnected_at <= self._holdover_s
        )
        if not after_outage or slot.health.state is not CircuitState.CLOSED:
            return False
        slot.held_until = self._clock() + self._holdover_s
        self._metrics.holdovers.labels(outcome="held").inc()
        logger.warning(
            "engine %s (%s, generation %d): Redis, back from an outage, lists it %s; held (still "
            "chosen) while it answers, until it is READY again, for at most %.0fs",
            slot.engine_id,
            slot.role.value,
            slot.record.generation,
            "no more" if view is None else f"{view.state.value if view.state else 'not READY'}",
            self._holdover_s,
        )
        self._export_ready()
        return True

    def _release_held(self, slot: EngineSlot, outcome: str) -> None:
        """A held engine leaves: its holdover ran out (``expired``) or a call failed."""
        self._metrics.holdovers.labels(outcome=outcome).inc()
        logger.warning(
            "engine %s (generation %d) held since the outage leaves the pool: %s",
            slot.engine_id,
            slot.record.generation,
            "a call failed" if outcome == "failed" else "not READY again in time",
        )
        self._registered_models.pop(slot.engine_id, None)
        self._remove(slot)

    def expire_held(self) -> None:
        """Remove held engines whose holdover ran out (called by :meth:`follow` as time
        passes, and by unit tests)."""
        now = self._clock()
        for slot in list(self._slots.values()):
            if slot.held_until is not None and now >= slot.held_until:
                self._release_held(slot, "expired")

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
        self._closers.start(connector.close())

    async def follow(self, control_plane: ControlPlane) -> None:
        """Apply every change the control plane's watcher reports, until cancelled.

        The watcher re-reads everything on start and after every reconnect, and keeps its last
        snapshot while Redis is unreachable (so does the pool); if it stops (an unexpected
        error), it is restarted after a pause, the pool keeping its last view meanwhile
        (logged). Held engines are expired as time passes.
        """
        self._export_ready()
        while True:
            try:
                async with control_plane.watch() as watcher:
                    self._watcher = watcher
                    self._following_since = None
                    resync = "reconnect" if self.synced else "start"
                    for engine_id, view in watcher.snapshot.items():
                        self.update(engine_id, view, resync=resync)
                    for engine_id in set(self._registered_models) - set(watcher.snapshot):
                        self.update(engine_id, None, resync=resync)
                    self._synced.set()
                    while True:
                        try:
                            change = await asyncio.wait_for(anext(watcher), _EXPIRY_CHECK_S)
                        except TimeoutError:
                            change = None
                        if watcher.reconnected_at is not None:  # (one without any change too)
                            self._reconnected_at = max(
                                watcher.reconnected_at, self._reconnected_at or 0.0
                            )
                        if change is not None:
                            self.update(change.engine_id, change.after, resync=change.resync)
                        self.expire_held()
            except asyncio.CancelledError:
                raise
            except StopAsyncIteration:
                logger.error("control-plane watcher stopped; restarting it")
            except Exception:
                logger.exception("control-plane watcher failed; restarting it")
            finally:
                if self._watcher is not None and self._following_since is None:
                    self._following_since = self._watcher.unreachable_since or self._clock()
                self._watcher = None
            await asyncio.sleep(_FOLLOW_RETRY_S)

    async def close(self) -> None:
        """Close every connector."""
        slots = list(self._slots.values())
        self._slots.clear()
        self._ordered.clear()
        for slot in slots:
            with contextlib.suppress(Exception):
                await slot.connector.close()
        await self._closers.wait()


class Reservation:
    """A request in flight on an engine slot (:meth:`EnginePool.reserve`): ``inflight`` counts
    it from ``__enter__`` to ``__exit__``, and a retired slot's connector closes when its last
    reservation ends. With ``call`` (:meth:`EnginePool.call`), one call on the engine as its
    circuit breaker sees it: begun on entering, a success on leaving without an exception. A
    class, not a ``contextlib`` generator: two per request."""

    __slots__ = ("_call", "_pool", "_slot")

    def __init__(self, pool: EnginePool, slot: EngineSlot, *, call: bool) -> None:
        self._pool = pool
        self._slot = slot
        self._call = call

    def __enter__(self) -> EngineSlot:
        if self._call:
            self._slot.health.begin_call()
        self._slot.inflight += 1
        return self._slot

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        self._pool._released(self._slot)
        if self._call and exc_type is None:
            self._slot.health.success()
