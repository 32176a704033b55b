"""Bookkeeping of in-flight pulls, independent of NIXL: reads, failures, due notifications.

A :class:`PullState` holds the reads of one :class:`~services.kv_transfer.transport.PullSpec`;
each :class:`ReadState` ends once, as done or as failed (:meth:`ReadState.fail`). The transport
asks :meth:`PullState.due_notifications` after each progress step: one notice per producer rank
whose reads all ended, and one per unread replica (``notify_only``) once the whole pull ended,
never to a producer that is gone or fenced (see :data:`NO_NOTIFY_REASONS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.control_plane.wire import EngineId
from services.kv_transfer.allocator import BlockArray
from services.kv_transfer.transport import FailedRead, PeerTransferStats, PullResult, PullSpec
from services.topology import PlannedRead
from services.topology.ranges import RankKey

PeerKey = tuple[EngineId, RankKey]

NO_NOTIFY_REASONS = frozenset(
    {
        "unknown_peer",
        "stale_generation",
        "peer_removed",
        "peer_replaced",
        "closed",
        "remote_disconnected",
    }
)
"""Failures after which the producer worker is told nothing: it is gone or not ours to tell."""


@dataclass
class ReadState:
    """One planned read of a pull and, once posted, its transfer handle."""

    read: PlannedRead
    peer: PeerKey
    local_ids: BlockArray
    remote_ids: BlockArray
    handle: Any = None
    nbytes: int = 0
    descriptors: int = 0
    prep_seconds: float = 0.0
    posted_at: float = 0.0
    completed_at: float = 0.0
    done: bool = False
    failure: FailedRead | None = None

    def fail(self, reason: str, message: str) -> None:
        """End the read as failed, naming its blocks (the caller releases the handle)."""
        self.done = True
        self.failure = FailedRead(
            producer_rank=self.peer[1],
            layers=self.read.layers,
            kv_heads=self.read.kv_heads,
            local_block_ids=tuple(self.local_ids.tolist()),
            remote_block_ids=tuple(self.remote_ids.tolist()),
            reason=reason,
            message=message,
        )


@dataclass
class PullState:
    """One pending pull."""

    spec: PullSpec
    started: float
    deadline: float
    setup_seconds: float = 0.0
    reads: list[ReadState] = field(default_factory=list)
    notified: set[RankKey] = field(default_factory=set)
    unnotified: list[RankKey] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return all(read.done for read in self.reads)

    def due_notifications(self) -> list[tuple[RankKey, bool]]:
        """``(producer rank, ok)`` of the notices due now; each is returned once."""
        by_rank: dict[RankKey, list[ReadState]] = {}
        for read in self.reads:
            by_rank.setdefault(read.peer[1], []).append(read)
        if self.done:
            for rank in self.spec.notify_only:
                by_rank.setdefault(rank, [])
        pull_failed = any(read.failure is not None for read in self.reads)
        due = []
        for rank, reads in by_rank.items():
            if rank in self.notified or not all(r.done for r in reads):
                continue
            self.notified.add(rank)
            failures = [r.failure for r in reads if r.failure is not None]
            if any(f.reason in NO_NOTIFY_REASONS for f in failures):
                continue
            due.append((rank, not failures if reads else not pull_failed))
        return due

    def result(self, now: float) -> PullResult:
        stats = tuple(
            PeerTransferStats(
                producer_rank=r.peer[1],
                nbytes=r.nbytes,
                descriptors=r.descriptors,
                prep_seconds=r.prep_seconds,
                seconds=max(r.completed_at - r.posted_at, 0.0),
            )
            for r in self.reads
            if r.failure is None and len(r.local_ids)  # a read of no block moved nothing
        )
        return PullResult(
            request_id=self.spec.request_id,
            producer_engine=self.spec.producer_engine,
            producer_generation=self.spec.producer_generation,
            transfers=stats,
            failures=tuple(r.failure for r in self.reads if r.failure is not None),
            seconds=now - self.started,
            setup_seconds=self.setup_seconds,
            unnotified=tuple(self.unnotified),
        )
