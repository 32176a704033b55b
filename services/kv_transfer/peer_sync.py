"""Pre-warming from the control plane: connect to producers when they turn READY, not on a request.

:class:`PeerSync` turns :class:`~services.control_plane.watch.EngineChange` events into
:meth:`KVConsumer.connect` / :meth:`KVConsumer.disconnect` calls:

- a compatible producer engine (role ``prefill`` or ``both``, the consumer's compat hash) that
  is READY and not yet connected at its generation: read its topology (re-validated by the
  control plane) and connect, which adds its agents and prepares descriptor lists;
- a connected engine that is gone, not READY any more, or READY at another generation: disconnect
  first (its pending pulls fail with ``stale_generation``), then connect to the new generation.

A producer that cannot be connected (its agent is unreachable, its topology stopped validating)
is logged, counted in ``pdserve_kv_transfer_prewarm_failures_total`` and retried on its next
change, on every :meth:`PeerSync.resync` and, while :meth:`PeerSync.follow` runs, every
``retry_interval_s`` from the watcher's snapshot (a READY engine may never change again). The NIXL
calls are short and synchronous; they run on the caller's event loop, which is the engine
worker's loop that also polls the consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable

from services.control_plane import ControlPlane, ControlPlaneError
from services.control_plane.base import AbstractEngineWatcher, EngineChange, EngineView
from services.control_plane.wire import EngineId
from services.kv_transfer.consumer import KVConsumer
from services.kv_transfer.errors import KVTransferError
from services.kv_transfer.metrics import KVTransferMetrics

logger = logging.getLogger(__name__)


class PeerSync:
    """Keeps one consumer worker connected to every READY compatible producer engine."""

    def __init__(
        self,
        consumer: KVConsumer,
        control_plane: ControlPlane,
        *,
        compat_hash: str,
        own_engine_id: EngineId | None = None,
        metrics: KVTransferMetrics | None = None,
        retry_interval_s: float = 2.0,
    ) -> None:
        """``retry_interval_s``: how often :meth:`follow` retries producers that failed to
        pre-warm (the default is the control plane's default ``resync_interval_s``)."""
        self._consumer = consumer
        self._control_plane = control_plane
        self._compat_hash = compat_hash
        self._own_engine_id = own_engine_id
        self._metrics = metrics if metrics is not None else KVTransferMetrics()
        self._retry_interval_s = retry_interval_s
        self._failed: set[EngineId] = set()

    def wants(self, view: EngineView | None) -> bool:
        """Whether this consumer should be connected to the engine ``view`` shows."""
        return (
            view is not None
            and view.ready
            and view.record is not None
            and view.engine_id != self._own_engine_id
            and view.record.role.produces_kv
            and view.record.compat_hash == self._compat_hash
        )

    async def apply(self, change: EngineChange) -> None:
        """Bring the connection to ``change.engine_id`` in line with ``change.after``."""
        await self._reconcile(change.engine_id, change.after)

    async def resync(self, views: Iterable[EngineView]) -> None:
        """Reconcile every engine of a snapshot (``watcher.snapshot.values()``).

        Retries producers that failed to pre-warm; removals arrive as changes.
        """
        for view in views:
            await self._reconcile(view.engine_id, view)

    async def follow(self, watcher: AbstractEngineWatcher) -> None:
        """Apply every change of ``watcher`` until it stops (run it as a task).

        Producers that failed to pre-warm are retried every ``retry_interval_s`` from the
        watcher's snapshot (connecting is idempotent per generation).
        """
        await self.resync(watcher.snapshot.values())
        changes = aiter(watcher)
        next_retry = time.monotonic() + self._retry_interval_s
        while True:
            timeout = max(next_retry - time.monotonic(), 0.0) if self._failed else None
            try:
                change = await asyncio.wait_for(anext(changes), timeout)
            except StopAsyncIteration:
                return
            except TimeoutError:
                change = None
            if change is not None:
                await self.apply(change)
            if time.monotonic() >= next_retry:
                snapshot = watcher.snapshot
                for engine_id in sorted(self._failed):
                    await self._reconcile(engine_id, snapshot.get(engine_id))
                next_retry = time.monotonic() + self._retry_interval_s

    async def _reconcile(self, engine_id: EngineId, view: EngineView | None) -> None:
        self._failed.discard(engine_id)
        connected = self._consumer.connected(engine_id)
        wanted = self.wants(view)
        target = view.generation if wanted and view is not None else None
        if connected is not None and connected != target:
            reason = "peer_removed" if target is None else "stale_generation"
            self._consumer.disconnect(engine_id, reason=reason)
            logger.info("disconnected producer %s generation %s (%s)", engine_id, connected, reason)
        if target is None or connected == target:
            return
        try:
            topology = await self._control_plane.get_topology(engine_id)
            if topology.engine.generation != target:
                return  # it changed again meanwhile; the next change brings the new state
            self._consumer.connect(topology)
        except (ControlPlaneError, KVTransferError) as exc:
            self._metrics.prewarm_failures.labels(
                producer_engine=engine_id, reason=exc.reason
            ).inc()
            self._failed.add(engine_id)
            logger.warning("could not pre-warm producer %s: %s", engine_id, exc)
            return
        logger.info("pre-warmed producer %s generation %d", engine_id, target)
