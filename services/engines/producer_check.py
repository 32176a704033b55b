"""Whether a KV handle's producer may be pulled from: one decision for every consumer.

The one consumer of this rule is the Decode RPC's :class:`~services.decode.servicer.ProducerGate`
(backends do not repeat it: :meth:`~services.engines.backend.EngineBackend.decode`): it reads the
producer's registration from the control plane and asks :func:`producer_refusal`; ``None``
means the pull may start. The refusals, in order:

- ``gone``: the producer is not registered -> :class:`ProducerUnavailable`;
- ``stale_generation``: it is at another generation than the handle (it restarted or
  re-registered; that KV is gone or must not be read with old addresses) -> ``ProducerUnavailable``;
- ``not_ready``: its current generation is not READY -> ``ProducerUnavailable``;
- ``not_a_producer``: it is a decode engine -> :class:`InvalidRequest`;
- ``incompatible``: another model or KV format (compat hash) -> ``InvalidRequest``;
- ``block_size``: blocks of another size (checked when the consumer gives its own) ->
  ``ProducerUnavailable``.

A control-plane error while reading the registration is :func:`control_plane_refusal`
(``ProducerUnavailable``, reason ``control_plane``). :class:`ProducerViews` is how consumers read
registrations: it rides out a short control-plane outage on the last view read of each producer
(counted; views at most ``max_stale_s`` old when the outage began; the safety argument is in
its docstring).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from services.config import ControlPlaneSettings
from services.control_plane.base import AbstractEngineWatcher, ControlPlane, EngineView
from services.control_plane.errors import ControlPlaneError, ControlPlaneUnavailable
from services.control_plane.wire import EngineId
from services.engines.errors import InvalidRequest, ProducerUnavailable, RequestError
from services.engines.requests import KVHandle

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Refusal:
    """Why a handle's producer cannot be pulled from: the error to raise and its metric label."""

    error: type[RequestError]
    reason: str
    message: str
    cause: BaseException | None = None
    """The control-plane error behind a ``control_plane`` refusal (chained on raising)."""

    def exception(self) -> RequestError:
        error = self.error(self.message)
        error.__cause__ = self.cause
        return error


def producer_refusal(
    view: EngineView | None,
    handle: KVHandle,
    *,
    compat_hash: str,
    block_size: int | None = None,
) -> Refusal | None:
    """What refuses a pull of ``handle`` given its producer's ``view``, or ``None``.

    ``compat_hash`` is the consumer's; ``block_size`` too, or ``None`` to not compare block
    sizes. Pure: reads nothing but its arguments.
    """
    producer = handle.producer_engine_id
    if view is None or view.record is None:
        return Refusal(ProducerUnavailable, "gone", f"producer engine {producer} is not registered")
    if view.generation != handle.generation:
        return Refusal(
            ProducerUnavailable,
            "stale_generation",
            f"producer engine {producer} is at generation {view.generation}, the handle names "
            f"generation {handle.generation} (it restarted; that KV is gone)",
        )
    if not view.ready:
        state = view.state.value if view.state else "unknown"
        return Refusal(
            ProducerUnavailable,
            "not_ready",
            f"producer engine {producer} is not READY (state {state})",
        )
    record = view.record
    if not record.role.produces_kv:
        return Refusal(
            InvalidRequest,
            "not_a_producer",
            f"engine {producer} is a decode engine, not a KV producer",
        )
    if record.compat_hash != compat_hash:
        return Refusal(
            InvalidRequest,
            "incompatible",
            f"producer engine {producer} serves an incompatible model or KV layout "
            f"(compat hash {record.compat_hash} != {compat_hash})",
        )
    if block_size is not None and record.shape.block_size != block_size:
        return Refusal(
            ProducerUnavailable,
            "block_size",
            f"producer engine {producer} uses blocks of {record.shape.block_size} tokens, this "
            f"engine {block_size}",
        )
    return None


def control_plane_refusal(producer: EngineId, error: Exception) -> Refusal:
    """The refusal when the producer's registration could not be read."""
    return Refusal(
        ProducerUnavailable,
        "control_plane",
        f"cannot confirm producer {producer} is READY: control plane error: {error}",
        cause=error,
    )


FALLBACK_OUTCOMES = ("last_known", "refused")
"""The ``outcome`` labels of :class:`ProducerViews`' fallback counter."""

DEFAULT_RETRY_AFTER_S = 1.0
"""How long after a failed read :class:`ProducerViews` answers without asking Redis."""

STALE_FACTOR = 3
"""The default ``max_stale_s`` is this many lease TTLs."""

_OUTAGE_LOG_INTERVAL_S = 30.0
"""While the control plane stays down, the warning is repeated at most this often."""

_MAX_REMEMBERED = 4096
"""Producers remembered at most (the oldest view is dropped first)."""


class ProducerViews:
    """Producers' registrations as the producer checks read them; rides out a short
    control-plane outage on the last view read of each producer.

    One instance per consumer engine (the host builds it with the engine service's settings and
    metrics and hands it to the Decode RPC's gate). Not thread-safe: used
    from one event loop.

    :meth:`refusal` reads the producer's :class:`EngineView` with
    :meth:`ControlPlane.get_engine` and decides with :func:`producer_refusal`; every view read
    is remembered with the time it was read (at most ``max_entries`` producers, views older
    than ``max_stale_s`` dropped; a producer read as unregistered is forgotten). When the read
    fails because the control plane is *unavailable* (:class:`ControlPlaneUnavailable`, Redis
    unreachable after the client's retries; not ``reason="auth"``, which is a configuration
    error), the remembered view answers instead if it was read at most ``max_stale_s`` before
    the outage began (its first failed read), however long the outage lasts:
    counted as ``on_fallback("last_known")``; without one, or with one too old, the check is
    refused as before (:func:`control_plane_refusal`, reason ``control_plane``) and counted as
    ``on_fallback("refused")``. Any other control-plane error (auth, a rejected command, a
    malformed record) is refused and not counted here: nothing is masked.

    Fast path: after a failed read, reads within ``retry_after_s`` do not ask Redis at all
    (each would pay the client's retries and backoff) and answer as above from memory; the
    first read after that asks Redis again. A warning is logged when an outage begins (again
    at most every 30 s while it lasts) and one line when a read succeeds again.

    Why a remembered view is safe: a KV handle names its producer's generation, and a
    producer at that generation stays valid until it re-registers (a restart, or its
    registration lost), which needs the control plane. While the control plane is down nobody
    can register a new generation, so a READY view at the handle's generation that was fresh
    when the outage began is the best knowledge anyone has for as long as it lasts (a producer
    cut off from a Redis the others still reach registers a new generation: its handles name
    it, and the remembered view refuses them); :func:`producer_refusal` still applies to it
    (another generation, not READY, incompatible: refused). If the producer died meanwhile, the
    pull from its NIXL agent fails (``KVTransferFailed``, explicit and counted by the data
    plane), so a stale view can cost a failed request, never wrong data. What the outage
    cannot vouch for is a view already old when it began (a restart while Redis was up may have
    been missed): ``max_stale_s`` bounds that age (default :data:`STALE_FACTOR` lease TTLs; so
    pairings stop only for producers whose generation cannot be checked, issue 49); 0 turns the
    fallback off.

    Cached view: while :meth:`follow` runs (the host runs it for consumer engines), a live
    :class:`~services.control_plane.watch.EngineWatcher` keeps every engine's view, and a
    handle that view *accepts* is accepted without a Redis read (one round trip less per
    Decode). Only acceptances come from the watcher: a view it would refuse (unknown, another
    generation, not READY, ...) may be the watcher lagging a re-registration, so that check
    reads Redis as above and refuses only on what Redis says. The watcher trails Redis by the
    events in flight (milliseconds) and, for a lease that expires without an event, by its
    resync interval; in that window a handle of a producer that just died is accepted and its
    pull fails (``KVTransferFailed``), the same bound as the outage argument above: a failed
    request, never wrong data. A watcher that lost Redis is not used until it re-read
    everything. A view the watcher accepted is remembered as if read then, so the outage rule
    above has it.
    """

    def __init__(
        self,
        control_plane: ControlPlane,
        *,
        max_stale_s: float,
        retry_after_s: float = DEFAULT_RETRY_AFTER_S,
        on_fallback: Callable[[str], None] | None = None,
        max_entries: int = _MAX_REMEMBERED,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``on_fallback`` is called with an outcome of :data:`FALLBACK_OUTCOMES` for every
        check the control plane could not answer; it may be ``None`` only when nothing falls
        back (``max_stale_s == 0``: the caller counts its refusals itself)."""
        if max_stale_s < 0 or retry_after_s < 0 or max_entries < 1:
            raise ValueError("max_stale_s and retry_after_s must be >= 0, max_entries >= 1")
        if on_fallback is None and max_stale_s > 0:
            raise ValueError("a fallback to remembered views must be counted: pass on_fallback")
        self.control_plane = control_plane
        self.max_stale_s = max_stale_s
        self.retry_after_s = retry_after_s
        self._on_fallback = on_fallback
        self._max_entries = max_entries
        self._clock = clock
        self._views: OrderedDict[EngineId, tuple[float, EngineView]] = OrderedDict()
        self._skip_until = 0.0
        """Until then reads do not ask the control plane (the fast path during an outage)."""
        self._outage: _Outage | None = None
        self._watcher: AbstractEngineWatcher | None = None

    async def refusal(
        self, handle: KVHandle, *, compat_hash: str, block_size: int | None = None
    ) -> Refusal | None:
        """What refuses a pull of ``handle`` (as :func:`producer_refusal`), or ``None``; a
        failed read is a :func:`control_plane_refusal` unless a remembered view answers.
        Never raises a control-plane error."""
        producer = handle.producer_engine_id
        watcher = self._watcher
        if watcher is not None and watcher.live:
            cached = watcher.view(producer)
            if (
                cached is not None
                and producer_refusal(cached, handle, compat_hash=compat_hash, block_size=block_size)
                is None
            ):
                # Remembered as a read: without it, an outage that begins now finds no view
                # and refuses every handle (the watcher answers nearly every check).
                self._remember(producer, cached)
                if self._outage is not None:  # the watcher re-read Redis: the outage is over
                    self._outage_over()
                return None
        now = self._clock()
        if now < self._skip_until:
            assert self._outage is not None  # set together with _skip_until
            return self._from_memory(handle, self._outage.error, now, compat_hash, block_size)
        try:
            view = await self.control_plane.get_engine(producer)
        except ControlPlaneUnavailable as exc:
            if exc.reason == "auth":
                return control_plane_refusal(producer, exc)
            now = self._clock()
            self._skip_until = now + self.retry_after_s
            self._outage_seen(exc, now)
            return self._from_memory(handle, exc, now, compat_hash, block_size)
        except ControlPlaneError as exc:
            return control_plane_refusal(producer, exc)
        self._outage_over()
        self._remember(producer, view)
        return producer_refusal(view, handle, compat_hash=compat_hash, block_size=block_size)

    async def follow(self, control_plane: ControlPlane) -> None:
        """Keep a watcher of ``control_plane`` for the cached view (see the class docstring)
        until cancelled. ``control_plane`` should have its own metrics registry: the watcher
        exports the state of every engine it sees on it."""
        async with control_plane.watch() as watcher:
            self._watcher = watcher
            try:
                async for _ in watcher:  # drained: only the snapshot is read
                    pass
            finally:
                self._watcher = None

    def remembered(self, producer: EngineId) -> tuple[float, EngineView] | None:
        """``(read at, view)`` of ``producer`` as remembered (for tests and diagnostics)."""
        return self._views.get(producer)

    # -- internals --------------------------------------------------------------------------

    def _from_memory(
        self,
        handle: KVHandle,
        error: ControlPlaneError,
        now: float,
        compat_hash: str,
        block_size: int | None,
    ) -> Refusal | None:
        producer = handle.producer_engine_id
        entry = self._views.get(producer)
        outage = self._outage
        # Aged at the outage's start: nothing registers during it (see the class docstring).
        as_of = outage.since if outage is not None else now
        if entry is None or as_of - entry[0] > self.max_stale_s:
            self._count("refused")
            if outage is not None:
                outage.refused += 1
            return control_plane_refusal(producer, error)
        self._count("last_known")
        if outage is not None:
            outage.answered += 1
        return producer_refusal(entry[1], handle, compat_hash=compat_hash, block_size=block_size)

    def _count(self, outcome: str) -> None:
        if self._on_fallback is not None:
            self._on_fallback(outcome)

    def _remember(self, producer: EngineId, view: EngineView | None) -> None:
        self._views.pop(producer, None)
        now = self._clock()
        if view is not None and self.max_stale_s > 0:
            self._views[producer] = (now, view)
        # Oldest first: drop what is too old to answer, and anything past the bound.
        while self._views:
            read_at, _ = next(iter(self._views.values()))
            if now - read_at <= self.max_stale_s and len(self._views) <= self._max_entries:
                break
            self._views.popitem(last=False)

    def _outage_seen(self, error: ControlPlaneUnavailable, now: float) -> None:
        outage = self._outage
        if outage is None:
            self._outage = outage = _Outage(error, since=now)
        outage.error = error
        if outage.logged_at is None or now - outage.logged_at >= _OUTAGE_LOG_INTERVAL_S:
            outage.logged_at = now
            logger.warning(
                "control plane unavailable for producer checks (for %.1fs: %s); answering from "
                "views read at most %.0fs before it began (%d so far, %d refused), asking "
                "again every %.1fs",
                now - outage.since,
                error,
                self.max_stale_s,
                outage.answered,
                outage.refused,
                self.retry_after_s,
            )

    def _outage_over(self) -> None:
        outage = self._outage
        if outage is None:
            return
        self._outage = None
        self._skip_until = 0.0
        logger.warning(
            "control plane available again for producer checks after %.1fs: %d checks were "
            "answered from remembered views, %d refused",
            self._clock() - outage.since,
            outage.answered,
            outage.refused,
        )


@dataclass
class _Outage:
    """The control-plane outage :class:`ProducerViews` is riding out."""

    error: ControlPlaneError
    since: float
    logged_at: float | None = None
    answered: int = 0
    refused: int = 0


PRODUCER_CHECK_RETRY_ATTEMPTS = 1
"""Retries of one producer-check read: one covers a pooled connection that Redis closed (a
restart); more would make every request wait out the backoff during an outage, which
:class:`ProducerViews` rides out on remembered views instead."""


def producer_check_settings(settings: ControlPlaneSettings) -> ControlPlaneSettings:
    """``settings`` for the control-plane client that reads producers' views: the same Redis
    with at most :data:`PRODUCER_CHECK_RETRY_ATTEMPTS` retries (the other clients keep theirs)."""
    redis = settings.redis
    retries = min(redis.retry_attempts, PRODUCER_CHECK_RETRY_ATTEMPTS)
    return settings.model_copy(
        update={"redis": redis.model_copy(update={"retry_attempts": retries})}
    )
