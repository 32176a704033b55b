"""Completion across ranks: when an engine has a request's KV, and when a producer may free it.

Two state machines, both pure (a clock and a :class:`BlockAllocator` are injected):

:class:`CompletionTracker` (consumer engine)
    A request's KV counts as received by the engine only when every one of its PP x TP ranks
    has reported it, each exactly once (non-final PP ranks report too, as in vLLM PR #43732).
    ``pending -> complete``; a second report from a rank is a :class:`DuplicateReportError`,
    also after completion (a bounded memory of completed requests catches late duplicates).

:class:`ProducerLeases` (producer worker)
    ``hold`` takes one reference on a request's blocks with a deadline. Each consumer rank's
    notification is counted once; when the expected number of distinct consumer ranks have
    notified, the lease ends ``released``; at its deadline it ends ``expired``. Either way the
    lease's reference is dropped, so the blocks return to the pool once the engine has dropped
    its own. Duplicate, unknown and foreign notifications are classified, never counted.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

from services.control_plane.wire import EngineId
from services.kv_transfer.allocator import BlockAllocator
from services.kv_transfer.errors import DuplicateReportError, LeaseError, UnknownRankError
from services.kv_transfer.metrics import KVTransferMetrics
from services.kv_transfer.protocol import BlockIds, KVNotification, RequestId, rank_label
from services.topology.ranges import RankKey


@dataclass(frozen=True)
class RankReport:
    """One rank's word on one request: done, or failed with these local blocks."""

    rank: RankKey
    ok: bool = True
    failed_block_ids: BlockIds = ()


@dataclass(frozen=True)
class EngineCompletion:
    """Every rank of the engine has reported the request."""

    request_id: RequestId
    reports: tuple[RankReport, ...]
    """One per rank, in rank order."""

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.reports)

    @property
    def failed_ranks(self) -> tuple[RankKey, ...]:
        return tuple(r.rank for r in self.reports if not r.ok)

    @property
    def failed_block_ids(self) -> BlockIds:
        return tuple(sorted({b for r in self.reports for b in r.failed_block_ids}))


class CompletionTracker:
    """Per-request reports of an engine's PP x TP ranks. Not thread-safe."""

    def __init__(
        self,
        ranks: Iterable[RankKey],
        *,
        engine_id: EngineId = "",
        metrics: KVTransferMetrics | None = None,
        remember_completed: int = 65536,
    ) -> None:
        """``ranks``: the engine's PP x TP grid; ``engine_id`` and ``metrics`` count duplicates."""
        self._ranks = frozenset(ranks)
        self._engine_id = engine_id
        self._metrics = metrics
        if not self._ranks:
            raise ValueError("an engine has at least one rank")
        self._pending: dict[RequestId, dict[RankKey, RankReport]] = {}
        self._completed: OrderedDict[RequestId, None] = OrderedDict()
        self._remember = remember_completed
        self.duplicates = 0
        """Duplicate reports refused so far."""

    @property
    def ranks(self) -> frozenset[RankKey]:
        return self._ranks

    def report(
        self,
        request_id: RequestId,
        rank: RankKey,
        *,
        ok: bool = True,
        failed_block_ids: Iterable[int] = (),
    ) -> EngineCompletion | None:
        """Record ``rank``'s report; return the completion when it was the last one missing.

        Raises :class:`UnknownRankError` for a rank outside the grid and
        :class:`DuplicateReportError` when ``rank`` already reported ``request_id``.
        """
        if rank not in self._ranks:
            raise UnknownRankError(f"{rank_label(rank)} is not a rank of this engine")
        reports = self._pending.get(request_id)
        if request_id in self._completed or (reports is not None and rank in reports):
            self.duplicates += 1
            if self._metrics is not None:
                self._metrics.duplicate_reports.labels(
                    consumer_engine=self._engine_id, consumer_rank=rank_label(rank)
                ).inc()
            raise DuplicateReportError(f"{rank_label(rank)} reported {request_id!r} twice")
        if reports is None:
            reports = self._pending[request_id] = {}
        reports[rank] = RankReport(rank, ok, tuple(failed_block_ids))
        if len(reports) < len(self._ranks):
            return None
        del self._pending[request_id]
        self._completed[request_id] = None
        while len(self._completed) > self._remember:
            self._completed.popitem(last=False)
        return EngineCompletion(request_id, tuple(reports[r] for r in sorted(reports)))

    def missing(self, request_id: RequestId) -> frozenset[RankKey]:
        """Ranks that have not reported a pending request (all ranks for an unknown one)."""
        return self._ranks - frozenset(self._pending.get(request_id, {}))

    def forget(self, request_id: RequestId) -> None:
        """Drop a pending request (aborted); later reports of it start it afresh."""
        self._pending.pop(request_id, None)

    def pending(self) -> int:
        return len(self._pending)


LeaseOutcome = Literal["released", "expired", "aborted"]
NotificationOutcome = Literal["counted", "duplicate", "unknown_request", "foreign_engine"]


@dataclass(frozen=True)
class LeaseEnd:
    """How a lease ended; its blocks' lease reference has been dropped."""

    request_id: RequestId
    block_ids: BlockIds
    outcome: LeaseOutcome
    consumer_engine: EngineId | None
    notified: frozenset[RankKey]
    expected: int | None
    any_failed: bool
    """Some consumer rank notified ``ok=False`` (it gave up reading)."""


@dataclass
class _Lease:
    block_ids: BlockIds
    deadline: float
    expected: int | None
    consumer_engine: EngineId | None = None
    notified: set[RankKey] = field(default_factory=set)
    any_failed: bool = False


class ProducerLeases:
    """Blocks held for consumers until they all notify or the lease expires. Not thread-safe."""

    def __init__(
        self,
        allocator: BlockAllocator,
        *,
        default_lease_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._allocator = allocator
        self._default_lease_s = default_lease_s
        self._clock = clock
        self._leases: dict[RequestId, _Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def request_ids(self) -> tuple[RequestId, ...]:
        """The requests holding a lease."""
        return tuple(self._leases)

    @property
    def held_blocks(self) -> int:
        """Lease references held (a block held by two leases counts twice)."""
        return sum(len(lease.block_ids) for lease in self._leases.values())

    def hold(
        self,
        request_id: RequestId,
        block_ids: Iterable[int],
        *,
        lease_s: float | None = None,
        expected_notifiers: int | None = None,
    ) -> None:
        """Take one reference on ``block_ids`` until the consumers are done or ``lease_s``.

        ``expected_notifiers`` (when the engine knows it) overrides the count that
        notifications carry. Raises :class:`LeaseError` when ``request_id`` is already held,
        and the allocator's :class:`BlockStateError` for blocks that are not allocated.
        """
        if request_id in self._leases:
            raise LeaseError(f"request {request_id!r} already holds a lease")
        if expected_notifiers is not None and expected_notifiers < 1:
            raise ValueError("expected_notifiers must be >= 1")
        blocks = tuple(block_ids)
        self._allocator.incref(blocks)
        lease_for = self._default_lease_s if lease_s is None else lease_s
        self._leases[request_id] = _Lease(blocks, self._clock() + lease_for, expected_notifiers)

    def notify(self, notification: KVNotification) -> tuple[NotificationOutcome, LeaseEnd | None]:
        """Count one consumer rank's notification; the lease end when it was the last one."""
        lease = self._leases.get(notification.request_id)
        if lease is None:
            return "unknown_request", None
        if lease.consumer_engine is None:
            lease.consumer_engine = notification.consumer_engine
        elif lease.consumer_engine != notification.consumer_engine:
            return "foreign_engine", None
        if notification.consumer_rank in lease.notified:
            return "duplicate", None
        lease.notified.add(notification.consumer_rank)
        lease.any_failed = lease.any_failed or not notification.ok
        if lease.expected is None:
            lease.expected = notification.expected_notifiers
        if len(lease.notified) < lease.expected:
            return "counted", None
        return "counted", self._end(notification.request_id, "released")

    def expire(self) -> list[LeaseEnd]:
        """End every lease past its deadline (outcome ``expired``)."""
        now = self._clock()
        due = [rid for rid, lease in self._leases.items() if lease.deadline <= now]
        return [self._end(rid, "expired") for rid in due]

    def abort(self, request_id: RequestId) -> LeaseEnd:
        """End a lease now (the engine aborted the request). Raises :class:`LeaseError`."""
        if request_id not in self._leases:
            raise LeaseError(f"request {request_id!r} holds no lease")
        return self._end(request_id, "aborted")

    def next_deadline(self) -> float | None:
        return min((lease.deadline for lease in self._leases.values()), default=None)

    def _end(self, request_id: RequestId, outcome: LeaseOutcome) -> LeaseEnd:
        lease = self._leases.pop(request_id)
        self._allocator.free(lease.block_ids)
        return LeaseEnd(
            request_id=request_id,
            block_ids=lease.block_ids,
            outcome=outcome,
            consumer_engine=lease.consumer_engine,
            notified=frozenset(lease.notified),
            expected=lease.expected,
            any_failed=lease.any_failed,
        )
