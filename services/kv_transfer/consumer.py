"""The consumer side of one worker: pre-warmed producer engines, pulls, policy and metrics.

The engine drives it from its loop::

    consumer.connect(topology)            # a producer engine turned READY (or a new generation)
    consumer.pull(request_id, producer_engine=..., producer_generation=...,
                  remote_block_ids=..., local_block_ids=...)
    for outcome in consumer.poll():       # every loop iteration
        ...                               # outcome.action: "done", "fail" or "recompute"
    consumer.disconnect(engine_id)        # the producer engine went away

The data plane never decides what a failure means for the request: it names the failed blocks
and applies the configured policy label (``fail``: the engine fails the request; ``recompute``:
the engine recomputes the failed blocks locally). Either way every failure is counted, by reason,
and every recompute too.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from services.control_plane.aggregation import EngineTopology
from services.control_plane.wire import EngineId, Generation
from services.kv_transfer.allocator import BlockArray
from services.kv_transfer.errors import UnknownPeerError
from services.kv_transfer.metrics import KVTransferMetrics, RankPair
from services.kv_transfer.planning import notification_plan, reads_for
from services.kv_transfer.protocol import BlockIds, RequestId
from services.kv_transfer.transport import KVTransport, PullResult, PullSpec
from services.topology import EngineLayout, PlannedRead
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)

FailurePolicy = Literal["fail", "recompute"]
PullAction = Literal["done", "fail", "recompute"]


@dataclass(frozen=True)
class PullOutcome:
    """A finished pull and what the engine should do with it."""

    result: PullResult
    action: PullAction

    @property
    def request_id(self) -> RequestId:
        return self.result.request_id

    @property
    def ok(self) -> bool:
        return self.result.ok

    @property
    def failed_block_ids(self) -> BlockIds:
        return self.result.failed_block_ids


@dataclass(frozen=True)
class _Connected:
    generation: Generation
    reads: tuple[PlannedRead, ...]
    notifiers: Mapping[RankKey, int]
    notify_only: tuple[RankKey, ...]


def _ids(block_ids: Sequence[int] | BlockArray) -> BlockIds | BlockArray:
    if isinstance(block_ids, (tuple, np.ndarray)):
        return block_ids
    return tuple(block_ids)


class KVConsumer:
    """Pulls for one consumer worker over a :class:`KVTransport`. Not thread-safe."""

    def __init__(
        self,
        transport: KVTransport,
        layout: EngineLayout,
        *,
        metrics: KVTransferMetrics | None = None,
        policy: FailurePolicy = "fail",
        default_timeout_s: float = 30.0,
    ) -> None:
        """``layout`` is the consumer engine's own PP x TP layout (for the notifier counts)."""
        if transport.identity.rank not in layout.shards:
            raise ValueError(f"rank {transport.identity.rank} is not in the consumer layout")
        self._transport = transport
        self._layout = layout
        self._metrics = metrics
        self._policy: FailurePolicy = policy
        self._default_timeout_s = default_timeout_s
        self._engines: dict[EngineId, _Connected] = {}

    @property
    def policy(self) -> FailurePolicy:
        return self._policy

    def connected(self, engine_id: EngineId) -> Generation | None:
        """The generation of ``engine_id`` this worker is connected to, if any."""
        entry = self._engines.get(engine_id)
        return None if entry is None else entry.generation

    def connect(self, topology: EngineTopology) -> None:
        """Plan this worker's reads from a READY producer engine and pre-warm those workers.

        Idempotent per generation. A new generation of a connected engine first fences the old
        one: its pending pulls fail with ``stale_generation``. Raises what
        :meth:`KVTransport.add_peer` raises; the engine then stays disconnected.
        """
        engine_id = topology.engine.engine_id
        generation = topology.engine.generation
        current = self._engines.get(engine_id)
        if current is not None:
            if current.generation == generation:
                return
            self.disconnect(engine_id, reason="stale_generation")
        me = self._transport.identity.rank
        reads = reads_for(me, self._layout, topology.layout)
        plan = notification_plan(self._layout, topology.layout)
        notify_only = plan.notify_only.get(me, ())
        try:
            for rank in sorted({(r.remote_pp, r.remote_tp) for r in reads} | set(notify_only)):
                started = time.perf_counter()
                self._transport.add_peer(topology.records[rank])
                if self._metrics is not None:
                    self._metrics.peer_prepare.labels(
                        **self._pair(engine_id, rank).labels()
                    ).observe(time.perf_counter() - started)
        except Exception:
            self._transport.remove_peer(engine_id, reason="peer_removed")
            raise
        self._engines[engine_id] = _Connected(generation, reads, plan.notifiers, notify_only)
        logger.info(
            "KV consumer %s connected to %s@%s: %d reads",
            self._transport.identity.label,
            engine_id,
            generation,
            len(reads),
        )

    def disconnect(self, engine_id: EngineId, *, reason: str = "peer_removed") -> None:
        """Forget a producer engine; its pending pulls fail with ``reason`` at the next poll."""
        self._engines.pop(engine_id, None)
        self._transport.remove_peer(engine_id, reason=reason)

    def pull(
        self,
        request_id: RequestId,
        *,
        producer_engine: EngineId,
        producer_generation: Generation,
        remote_block_ids: Sequence[int] | BlockArray,
        local_block_ids: Sequence[int] | BlockArray,
        timeout_s: float | None = None,
    ) -> None:
        """Start reading ``request_id``'s KV; its outcome comes from :meth:`poll`. No block
        (the consumer holds them all) only notifies the producer ranks, which free at once.

        Raises :class:`UnknownPeerError` when the producer engine is not connected (it never
        turned READY here, or was disconnected), and :class:`PullSpecError` for inconsistent
        block ids. Everything else comes back as data: a request prefilled by a generation that
        is no longer the connected one fails every read with ``stale_generation``.
        """
        spec = self.spec(
            request_id,
            producer_engine=producer_engine,
            producer_generation=producer_generation,
            remote_block_ids=remote_block_ids,
            local_block_ids=local_block_ids,
            timeout_s=timeout_s,
        )
        self._transport.start_pull(spec)
        identity = self._transport.identity
        if self._metrics is not None and not len(spec.local_block_ids) and identity.rank == (0, 0):
            # The consumer held every block (its prefix cache): this pull only notifies.
            # Counted once per request, by the engine's first rank.
            self._metrics.released.labels(
                producer_engine=producer_engine,
                consumer_engine=identity.engine_id,
                reason="consumer_holds_prompt",
            ).inc()

    def spec(
        self,
        request_id: RequestId,
        *,
        producer_engine: EngineId,
        producer_generation: Generation,
        remote_block_ids: Sequence[int] | BlockArray,
        local_block_ids: Sequence[int] | BlockArray,
        timeout_s: float | None = None,
    ) -> PullSpec:
        """The :class:`PullSpec` :meth:`pull` would issue (raises as :meth:`pull` does)."""
        entry = self._engines.get(producer_engine)
        if entry is None:
            raise UnknownPeerError(f"producer engine {producer_engine} is not connected")
        return PullSpec(
            request_id=request_id,
            producer_engine=producer_engine,
            producer_generation=producer_generation,
            reads=entry.reads,
            remote_block_ids=_ids(remote_block_ids),
            local_block_ids=_ids(local_block_ids),
            notifiers=entry.notifiers,
            notify_only=entry.notify_only,
            timeout_s=self._default_timeout_s if timeout_s is None else timeout_s,
        )

    def cancel(self, request_id: RequestId, producer_engine: EngineId) -> bool:
        """Abort a pending pull (it still comes back from :meth:`poll`, ``cancelled``)."""
        return self._transport.cancel_pull(request_id, producer_engine)

    def poll(self) -> list[PullOutcome]:
        """Progress pulls; return the finished ones, counted in the metrics."""
        outcomes = []
        for result in self._transport.poll():
            action: PullAction = "done" if result.ok else self._policy
            self._observe(result, action)
            if not result.ok:
                logger.warning(
                    "KV pull of %s from %s failed (%s): blocks %s -> %s",
                    result.request_id,
                    result.producer_engine,
                    ", ".join(sorted({f.reason for f in result.failures})),
                    list(result.failed_block_ids[:16]),
                    action,
                )
            outcomes.append(PullOutcome(result, action))
        return outcomes

    def pending(self) -> int:
        return self._transport.pending_pulls()

    def _pair(self, producer_engine: EngineId, producer_rank: RankKey) -> RankPair:
        ident = self._transport.identity
        return RankPair(producer_engine, ident.engine_id, producer_rank, ident.rank)

    def _observe(self, result: PullResult, action: PullAction) -> None:
        if self._metrics is None:
            return
        for stats in result.transfers:
            self._metrics.observe_transfer(
                self._pair(result.producer_engine, stats.producer_rank), stats
            )
        for failure in result.failures:
            self._metrics.observe_failure(
                self._pair(result.producer_engine, failure.producer_rank),
                failure,
                recompute=action == "recompute",
            )
        for rank in result.unnotified:
            pair = self._pair(result.producer_engine, rank)
            self._metrics.notification_send_failures.labels(**pair.labels()).inc()
