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
change and on every :meth:`PeerSync.resync`. The NIXL calls are short and synchronous; they run on
the caller's event loop, which is the engine worker's loop that also polls the consumer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from services.control_plane import ControlPlane, ControlPlaneError, EngineRole
from services.control_plane.base import EngineView
from services.control_plane.watch import EngineChange, EngineWatcher
from services.control_plane.wire import EngineId
from services.kv_transfer.consumer import KVConsumer
from services.kv_transfer.errors import KVTransferError
from services.kv_transfer.metrics import KVTransferMetrics

logger = logging.getLogger(__name__)

_PRODUCER_ROLES = (EngineRole.PREFILL, EngineRole.BOTH)


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
    ) -> None:
        self._consumer = consumer
        self._control_plane = control_plane
        self._compat_hash = compat_hash
        self._own_engine_id = own_engine_id
        self._metrics = metrics if metrics is not None else KVTransferMetrics()

    def wants(self, view: EngineView | None) -> bool:
        """Whether this consumer should be connected to the engine ``view`` shows."""
        return (
            view is not None
            and view.ready
            and view.record is not None
            and view.engine_id != self._own_engine_id
            and view.record.role in _PRODUCER_ROLES
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

    async def follow(self, watcher: EngineWatcher) -> None:
        """Apply every change of ``watcher`` until it stops (run it as a task)."""
        await self.resync(watcher.snapshot.values())
        async for change in watcher:
            await self.apply(change)

    async def _reconcile(self, engine_id: EngineId, view: EngineView | None) -> None:
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
            logger.warning("could not pre-warm producer %s: %s", engine_id, exc)
            return
        logger.info("pre-warmed producer %s generation %d", engine_id, target)
