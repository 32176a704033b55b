"""The producer side of one worker: leases on prefilled blocks, freed by notifications or expiry.

The engine drives it from its loop::

    producer.hold(request_id, block_ids)   # prefill done: consumers may now read these blocks
    pool.free(block_ids)                   # the engine drops its own reference when it likes
    events = producer.poll()               # every loop iteration, *also when idle*

:meth:`KVProducer.poll` must run every few milliseconds even without leases: with NIXL's
progress thread off it is what progresses the connection set-up of consumers pre-warming
themselves against this worker (their first read waits for it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.kv_transfer.completion import LeaseEnd, ProducerLeases
from services.kv_transfer.metrics import KVTransferMetrics, RankPair
from services.kv_transfer.protocol import RequestId
from services.kv_transfer.transport import KVTransport

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProducerEvents:
    """What one :meth:`KVProducer.poll` changed."""

    released: tuple[LeaseEnd, ...] = ()
    """Leases every expected consumer rank notified."""
    expired: tuple[LeaseEnd, ...] = ()
    """Leases that ran out first (counted in ``pdserve_kv_transfer_expired_leases_total``)."""
    rejected_notifications: tuple[str, ...] = ()


class KVProducer:
    """Leases of one producer worker over a :class:`KVTransport`. Not thread-safe."""

    def __init__(
        self,
        transport: KVTransport,
        *,
        metrics: KVTransferMetrics | None = None,
        default_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._transport = transport
        self._metrics = metrics
        self.leases = ProducerLeases(
            transport.pool.allocator, default_lease_s=default_lease_s, clock=clock
        )
        if metrics is not None:
            metrics.declare_producer(transport.identity.engine_id, transport.identity.rank)

    def hold(
        self,
        request_id: RequestId,
        block_ids: Iterable[int],
        *,
        lease_s: float | None = None,
        expected_notifiers: int | None = None,
    ) -> None:
        """Keep ``block_ids`` (one extra reference) until consumers notify or the lease ends.

        See :meth:`ProducerLeases.hold` for the arguments and errors.
        """
        self.leases.hold(
            request_id, block_ids, lease_s=lease_s, expected_notifiers=expected_notifiers
        )
        self._update_gauge()

    def abort(self, request_id: RequestId) -> LeaseEnd:
        """Drop a request's lease now (the engine aborted it)."""
        end = self.leases.abort(request_id)
        self._update_gauge()
        return end

    def poll(self) -> ProducerEvents:
        """Take the notifications that arrived, end the leases they complete, expire the rest."""
        ident = self._transport.identity
        batch = self._transport.poll_notifications()
        released: list[LeaseEnd] = []
        for notification in batch.received:
            outcome, end = self.leases.notify(notification)
            if self._metrics is not None:
                pair = RankPair(
                    ident.engine_id,
                    notification.consumer_engine,
                    ident.rank,
                    notification.consumer_rank,
                )
                self._metrics.observe_notification(
                    pair, outcome if notification.ok or outcome != "counted" else "failed"
                )
            if outcome != "counted":
                logger.info(
                    "KV notification %s for %s from %s: %s",
                    outcome,
                    notification.request_id,
                    notification.consumer_engine,
                    notification.consumer_rank,
                )
            if end is not None:
                released.append(end)
        for reason in batch.rejected:
            logger.warning("KV notification rejected: %s", reason)
            if self._metrics is not None:
                self._metrics.rejected_notifications.labels(
                    producer_engine=ident.engine_id, producer_rank=ident.label
                ).inc()
        expired = self.leases.expire()
        for end in expired:
            logger.warning(
                "KV lease of %s expired: %d of %s consumer ranks notified",
                end.request_id,
                len(end.notified),
                end.expected if end.expected is not None else "?",
            )
            if self._metrics is not None:
                self._metrics.observe_expired(ident.engine_id, ident.rank, end.consumer_engine)
        self._update_gauge()
        return ProducerEvents(tuple(released), tuple(expired), batch.rejected)

    def _update_gauge(self) -> None:
        if self._metrics is not None:
            ident = self._transport.identity
            self._metrics.leased_blocks.labels(
                producer_engine=ident.engine_id, producer_rank=ident.label
            ).set(self.leases.held_blocks)
