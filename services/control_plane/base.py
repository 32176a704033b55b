"""The control-plane seam: what engines, routers and tools may ask of the registry.

Protocol, grouped by caller:

*Engine host* (prefill or decode service, once per engine start):
  1. :meth:`ControlPlane.register` -> a new :class:`EngineRecord` with a new generation;
  2. :meth:`ControlPlane.heartbeat` every ``heartbeat_interval_s`` (renews the lease, refreshes
     load); a :class:`StaleGenerationError` or :class:`EngineNotFound` means the host lost its
     registration and must stop serving under it;
  3. :meth:`ControlPlane.deregister` on clean shutdown.

*Engine workers* (one per ``(pp_rank, tp_rank)``, or the engine's scheduler on behalf of all):
  :meth:`ControlPlane.publish_handshakes` with their :class:`HandshakeRecord`; the call that
  completes the grid aggregates it and announces READY (or INVALID) atomically;
  :meth:`ControlPlane.withdraw_handshake` when a worker goes away.

*Readers* (router, decode engines pre-warming NIXL, ``pdserve status``):
  :meth:`ControlPlane.list_engines`, :meth:`ControlPlane.get_engine`,
  :meth:`ControlPlane.inspect`, :meth:`ControlPlane.get_topology`, and :meth:`ControlPlane.watch`
  for changes. Readers re-validate what they read: a hostile or stale value is reported as a
  problem and counted, never raised as a crash.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from types import TracebackType

from services.control_plane.aggregation import Aggregation, EngineTopology
from services.control_plane.wire import (
    EngineId,
    EngineLoad,
    EngineRecord,
    EngineRole,
    EngineState,
    EngineStatus,
    Generation,
    HandshakeRecord,
)
from services.topology import ModelShape

STOPPING_CALL_BOUND_S = 5.0
"""A process that is stopping waits this long at most for one control-plane call (deregister,
withdraw): with Redis hung, each retry would otherwise wait its socket timeout. What it leaves
behind expires with its lease."""


@dataclass(frozen=True)
class EngineSpec:
    """What an engine host declares when it registers (the control plane adds the rest).

    One engine is described by three types, each a field-for-field subset of the next, copied
    by name (:meth:`record`, ``BackendDescription.spec``) so that a new field is one edit per
    type and a test (``tests/unit/test_engine_types.py``) fails when the sets drift:
    ``BackendDescription`` (what the backend knows of its model and layout, plus what only the
    serving side needs: EOS ids) -> ``EngineSpec`` (+ engine id, role, endpoint) ->
    ``EngineRecord`` (+ what the control plane assigns: generation, lease, registration time).
    All three embed the model's shape as one ``topology.ModelShape``; the spec and the record
    hold the part the record carries (:func:`~services.control_plane.wire.record_shape`), which
    the record's codec writes flat. Three stay because the record is the wire format stored in
    Redis (versioned by its fields), the spec is what a host may choose, and the description is
    the engine's, before it has an id or an address.
    """

    engine_id: EngineId
    role: EngineRole
    model: str
    compat_hash: str
    shape: ModelShape
    """The model's shape: only :data:`~services.control_plane.wire.RECORD_SHAPE_FIELDS`."""
    endpoint: str
    pp_aware: bool = True
    engine_kind: str = "reference"
    kv_events_endpoint: str = ""
    """Where the engine publishes KV-cache events (``tcp://host:port``; empty = none)."""
    kv_events_replay_endpoint: str = ""
    """The engine's KV-event replay endpoint (empty = none)."""
    kv_block_bytes: int = 0
    """The bytes of one KV block of the whole engine (0 = unknown)."""
    max_loras: int = 0
    """LoRA adapters the engine runs at once (0 = it serves none)."""

    def record(
        self, generation: Generation, *, lease_ttl_ms: int, registered_at_ms: int
    ) -> EngineRecord:
        """The record the control plane stores for this spec at ``generation``."""
        return EngineRecord(
            **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)},
            generation=generation,
            lease_ttl_ms=lease_ttl_ms,
            registered_at_ms=registered_at_ms,
        )


@dataclass(frozen=True)
class EngineView:
    """What a reader sees of one engine: each part ``None`` when absent or unreadable."""

    engine_id: EngineId
    record: EngineRecord | None
    status: EngineStatus | None
    load: EngineLoad | None
    problems: tuple[str, ...] = ()
    """Values that failed to decode (and so are ``None`` above)."""

    @property
    def generation(self) -> Generation | None:
        return self.record.generation if self.record else None

    @property
    def state(self) -> EngineState | None:
        if self.status is None or self.record is None:
            return None
        if self.status.generation != self.record.generation:
            return None
        return self.status.state

    @property
    def ready(self) -> bool:
        return self.state is EngineState.READY


@dataclass(frozen=True)
class EngineInspection:
    """An engine's view plus the verdict on its current handshake grid (for ``pdserve status``)."""

    view: EngineView
    aggregation: Aggregation | None


@dataclass(frozen=True)
class EngineChange:
    """One engine's transition: ``before`` is ``None`` when it appeared, ``after`` when gone."""

    engine_id: EngineId
    before: EngineView | None
    after: EngineView | None
    resync: str | None = None
    """The full re-read that found the change (``start``, ``reconnect``, ``periodic``), or
    ``None`` for one an event announced. ``reconnect``: the store was unreachable before that
    re-read, so an engine it no longer lists may be alive and re-registering (a store that came
    back empty)."""

    @property
    def became_ready(self) -> bool:
        """True when the engine is READY now and was not (or was another generation) before."""
        if self.after is None or not self.after.ready:
            return False
        return not (
            self.before is not None
            and self.before.ready
            and self.before.generation == self.after.generation
        )


class AbstractEngineWatcher(abc.ABC):
    """What :meth:`ControlPlane.watch` returns: a snapshot of every live engine kept current,
    and an async iterator of :class:`EngineChange`.

    Contract:

    * ``async with`` starts it; entering returns once the snapshot was read in full (so
      :attr:`snapshot` answers at once); leaving stops it and releases its connection.
    * Iterating yields one :class:`EngineChange` per engine that appeared, changed
      (generation, state, record, load) or disappeared, in the order seen; iteration ends
      once the watcher stopped. Changes may be coalesced or, after a lost connection,
      reported by a full re-read instead of one by one; none is lost for good.
    * :attr:`live` says whether the snapshot follows the store now (``False`` while
      reconnecting: readers may then prefer a direct read).
    """

    @property
    @abc.abstractmethod
    def snapshot(self) -> dict[EngineId, EngineView]:
        """The latest view of every live engine (a copy)."""

    @abc.abstractmethod
    def view(self, engine_id: EngineId) -> EngineView | None:
        """The latest view of ``engine_id`` (no copy of the snapshot), ``None`` if not live."""

    @property
    @abc.abstractmethod
    def live(self) -> bool:
        """True while the snapshot follows the store (see the class doc)."""

    @property
    @abc.abstractmethod
    def unreachable_since(self) -> float | None:
        """When (``time.monotonic()``) the watcher lost the store, ``None`` while it follows it:
        how stale the snapshot may be."""

    @property
    @abc.abstractmethod
    def reconnected_at(self) -> float | None:
        """When (``time.monotonic()``) the watcher last re-read the store after losing it,
        ``None`` if it never lost it."""

    @abc.abstractmethod
    async def __aenter__(self) -> AbstractEngineWatcher:
        """Start watching; returns once the snapshot was read."""

    @abc.abstractmethod
    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Stop watching and release the connection."""

    def __aiter__(self) -> AsyncIterator[EngineChange]:
        return self

    @abc.abstractmethod
    async def __anext__(self) -> EngineChange:
        """The next change; :class:`StopAsyncIteration` once the watcher stopped."""

    @abc.abstractmethod
    async def next_change(self, within_s: float) -> EngineChange:
        """The next change, or :class:`TimeoutError` after ``within_s`` seconds."""

    async def wait_for(
        self,
        engine_id: EngineId,
        state: EngineState,
        within_s: float,
        generation: int | None = None,
    ) -> EngineView:
        """Wait until ``engine_id`` (at ``generation``, if given) is in ``state``.

        The snapshot is checked first, so a state reached before the call counts.
        """
        deadline = time.monotonic() + within_s
        while True:
            view = self.view(engine_id)
            if (
                view is not None
                and view.state is state
                and (generation is None or view.generation == generation)
            ):
                return view
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"engine {engine_id} not {state.value} within {within_s}s")
            with contextlib.suppress(TimeoutError):
                await self.next_change(remaining)


class ControlPlane(abc.ABC):
    """The engine registry and handshake aggregation. All methods are coroutines.

    Every method raises :class:`ControlPlaneUnavailable` when the backing store stays
    unreachable after the configured retries with backoff.
    """

    @abc.abstractmethod
    async def register(self, spec: EngineSpec) -> EngineRecord:
        """Register ``spec`` under a new generation and return the stored record.

        Called by an engine host at every start (also a restart under the same engine id).
        Every earlier generation of the engine is fenced off from then on: its heartbeats,
        handshakes and deregistration fail with :class:`StaleGenerationError`, and its records
        are never served as current. The engine starts PENDING with an empty grid.
        """

    @abc.abstractmethod
    async def restore(self, spec: EngineSpec, generation: Generation) -> EngineRecord:
        """Register ``spec`` again at ``generation`` after its lease ran out, PENDING with an
        empty grid, as :meth:`register` left it.

        Only for the host that registered ``generation``, and only while no newer generation
        of the engine was registered since (else :class:`StaleGenerationError`): the same
        process keeps its generation, so handshakes of ranks that were started with it (vLLM
        bakes the generation into its connector at start-up) stay valid. The handshakes
        published before the lease ran out are gone: ranks must publish again.
        """

    @abc.abstractmethod
    async def heartbeat(
        self, engine_id: EngineId, generation: Generation, load: EngineLoad | None = None
    ) -> None:
        """Renew the lease of ``engine_id`` at ``generation`` and store ``load`` if given.

        Raises :class:`EngineNotFound` when the lease already expired (the host must register
        again) and :class:`StaleGenerationError` when a newer generation replaced it.
        """

    @abc.abstractmethod
    async def deregister(self, engine_id: EngineId, generation: Generation) -> None:
        """Remove the engine and its records now (clean shutdown); raises as heartbeat does."""

    @abc.abstractmethod
    async def publish_handshakes(
        self, engine: EngineRecord, records: Sequence[HandshakeRecord]
    ) -> EngineStatus | None:
        """Publish workers' handshake records for ``engine`` (one call may carry the whole grid).

        Records are checked first: :class:`PipelineParallelUnsupported` for ``pp_rank > 0`` from
        an engine that is not PP-aware, :class:`HandshakeRejected` for any other invalid record,
        :class:`DuplicateRankError` when another worker holds the rank. A worker may re-publish
        its own rank (the record is replaced). Returns the new :class:`EngineStatus` when this
        call completed the grid and announced READY or INVALID, else ``None``.
        """

    @abc.abstractmethod
    async def withdraw_handshake(
        self, engine: EngineRecord, pp_rank: int, tp_rank: int, worker_id: str
    ) -> None:
        """Remove one worker's record (the worker died or stopped); the engine turns PENDING."""

    @abc.abstractmethod
    async def list_engines(self) -> list[EngineView]:
        """Every engine with a live lease, sorted by id. Expired ones are pruned and counted."""

    @abc.abstractmethod
    async def get_engine(self, engine_id: EngineId) -> EngineView | None:
        """One engine's view, or ``None`` when it has no live lease."""

    @abc.abstractmethod
    async def get_engines(
        self, engine_ids: Sequence[EngineId]
    ) -> dict[EngineId, EngineView | None]:
        """Several engines' views in one round trip (``None`` for those without a lease)."""

    @abc.abstractmethod
    async def inspect(self, engine_id: EngineId) -> EngineInspection | None:
        """One engine's view and a fresh aggregation of its current grid (why not READY)."""

    @abc.abstractmethod
    async def get_topology(self, engine_id: EngineId) -> EngineTopology:
        """The READY engine's records and layout, re-validated on read.

        Raises :class:`EngineNotFound` or :class:`EngineNotReady` (with the problems) otherwise.
        """

    @abc.abstractmethod
    def watch(self, *, handshake_progress: bool = False) -> AbstractEngineWatcher:
        """A watcher of engine changes (an async context manager, see
        :class:`AbstractEngineWatcher`).

        ``handshake_progress`` also reports every rank's publication (grid displays).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Release connections. Idempotent."""
