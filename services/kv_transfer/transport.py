"""The KV transport seam: a worker's block pool exposed to peers, and pulls from theirs.

One transport per worker process, over that worker's :class:`KVBlockPool`. The protocol, step by
step and grouped by caller (an engine of role ``both`` plays both parts):

Every worker, at start-up
  1. Build the pool, then the transport over it: the pool is registered once, here.
  2. Publish :meth:`KVTransport.handshake_record` through the control plane.

Consumer rank, when a producer engine turns READY (before its first request)
  3. :meth:`KVTransport.add_peer` for each producer worker it will read from: the remote agent
     is added and the descriptor lists prepared, so no request pays for a handshake. A record of
     a new generation for a known ``(engine, rank)`` fences the old one (step 7).

Consumer rank, per request
  4. :meth:`KVTransport.start_pull` issues the reads of a :class:`PullSpec` and returns at once.
  5. :meth:`KVTransport.poll` returns each pull once, when all its reads ended, as a
     :class:`PullResult` naming any failed reads and blocks. When every read from one producer
     worker has ended, the transport sends that worker one
     :class:`~services.kv_transfer.protocol.KVNotification` (``ok`` false after a failure).
     A notice may still wait on its connection's set-up when the pull is returned, so a
     consumer keeps calling :meth:`KVTransport.poll` while idle: it progresses the transport.
  6. :meth:`KVTransport.cancel_pull` on abort.

Consumer rank, when a producer engine goes away or restarts
  7. :meth:`KVTransport.remove_peer`: pending pulls against it end as failures
     (``stale_generation`` or ``peer_removed``), then its agent is forgotten. Nothing is ever
     read from an agent after this.

Producer worker, continuously (also when idle)
  8. :meth:`KVTransport.poll_notifications`: the notifications that arrived. With NIXL's
     progress thread off (the default on CPU), this call also progresses connection set-up, so a
     producer that stops polling stalls its consumers' first pulls.

Shutdown
  9. :meth:`KVTransport.close`.

Transports are not thread-safe: one engine loop drives each.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.control_plane.wire import KV_LAYOUT_HND, EngineId, Generation, HandshakeRecord
from services.kv_transfer.allocator import BlockArray
from services.kv_transfer.protocol import BlockIds, KVNotification, RequestId, WorkerIdentity
from services.topology import PlannedRead, Range
from services.topology.ranges import RankKey

if TYPE_CHECKING:
    from services.kv_transfer.block_pool import KVBlockPool


@dataclass(frozen=True, eq=False)
class PullSpec:
    """One request's KV to read from one producer engine into this worker's pool.

    Block ids are engine-wide on each side (as in vLLM: every rank of an engine uses the same
    block table), and ``remote_block_ids[i]`` lands in ``local_block_ids[i]``. They may be
    tuples or int64 numpy arrays; arrays skip a per-id conversion (about 20 ns per id and side).
    """

    request_id: RequestId
    producer_engine: EngineId
    producer_generation: Generation
    """The generation the request was prefilled by; any other one is refused (fencing)."""
    reads: tuple[PlannedRead, ...]
    """This worker's reads, from :func:`~services.topology.plan_reads`."""
    remote_block_ids: BlockIds | BlockArray
    local_block_ids: BlockIds | BlockArray
    """Allocated local blocks (the transport refuses free ones)."""
    notifiers: Mapping[RankKey, int] = field(default_factory=dict)
    """Per producer rank: how many consumer ranks of this engine notify it (default 1)."""
    notify_only: tuple[RankKey, ...] = ()
    """Producer ranks (unread replicas) this worker notifies, without reading, when it is done."""
    timeout_s: float = 30.0
    """From :meth:`KVTransport.start_pull` until unfinished reads are aborted as ``timeout``."""


@dataclass(frozen=True)
class PeerTransferStats:
    """A completed read from one producer worker."""

    producer_rank: RankKey
    nbytes: int
    descriptors: int
    prep_seconds: float
    """Index arithmetic plus ``make_prepped_xfer``: the per-request descriptor cost."""
    seconds: float
    """From posting the read to seeing it complete."""


@dataclass(frozen=True)
class FailedRead:
    """A read that did not complete: which blocks (local and remote), layers and heads, and why."""

    producer_rank: RankKey
    layers: Range
    kv_heads: Range
    local_block_ids: BlockIds
    remote_block_ids: BlockIds
    reason: str
    """A metric label: ``timeout``, ``remote_disconnected``, ``stale_generation``..."""
    message: str


@dataclass(frozen=True)
class PullResult:
    """The end of one pull: what was read, what failed and how long it took."""

    request_id: RequestId
    producer_engine: EngineId
    producer_generation: Generation
    transfers: tuple[PeerTransferStats, ...]
    failures: tuple[FailedRead, ...]
    seconds: float
    """From :meth:`KVTransport.start_pull` to the poll that ended it."""
    setup_seconds: float = 0.0
    """Per-pull validation and block-id conversion, before the per-read descriptor work."""
    unnotified: tuple[RankKey, ...] = ()
    """Producer ranks whose notification could not be sent (they will free on lease expiry)."""

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def failed_block_ids(self) -> BlockIds:
        """Local blocks with at least one missing layer or head slice, ascending."""
        return tuple(sorted({b for f in self.failures for b in f.local_block_ids}))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.transfers)


@dataclass(frozen=True)
class Notifications:
    """What one :meth:`KVTransport.poll_notifications` call found."""

    received: tuple[KVNotification, ...] = ()
    rejected: tuple[str, ...] = ()
    """Why each undecodable notification was dropped."""


class KVTransport(ABC):
    """Moves KV blocks between workers' pools; see the module docstring for the protocol."""

    @property
    @abstractmethod
    def identity(self) -> WorkerIdentity:
        """The worker this transport serves."""

    @property
    @abstractmethod
    def pool(self) -> KVBlockPool:
        """The local pool, registered with the transport for the transport's whole life."""

    @property
    @abstractmethod
    def agent_name(self) -> str:
        """This worker's agent name: unique per worker incarnation."""

    @abstractmethod
    def agent_metadata(self) -> bytes:
        """The blob a peer needs to reach this worker (``HandshakeRecord.agent_metadata``)."""

    def handshake_record(
        self, *, worker_id: str, compat_hash: str, extra: bytes = b""
    ) -> HandshakeRecord:
        """The record this worker publishes through the control plane (step 2)."""
        pool, spec, ident = self.pool, self.pool.spec, self.identity
        return HandshakeRecord(
            engine_id=ident.engine_id,
            generation=ident.generation,
            pp_rank=ident.pp_rank,
            tp_rank=ident.tp_rank,
            worker_id=worker_id,
            agent_name=self.agent_name,
            agent_metadata=self.agent_metadata(),
            memory_type=pool.memory_type,
            device_id=pool.device_id,
            region_base_addrs=tuple(int(t.data_ptr()) for t in pool.regions()),
            num_blocks=spec.num_blocks,
            block_len=spec.block_len,
            block_stride=spec.block_len,
            block_size=spec.block_size,
            dtype=spec.dtype,
            head_size=spec.head_size,
            kv_layout=KV_LAYOUT_HND,  # the pool's (block_pool.KV_LAYOUT)
            layers=spec.layers,
            kv_heads=spec.kv_heads,
            compat_hash=compat_hash,
            extra=extra,
        )

    @abstractmethod
    def add_peer(self, record: HandshakeRecord) -> None:
        """Pre-warm a producer worker (step 3). Called by the consumer side when the producer's
        engine turns READY. Idempotent for the same record; a record of another generation for
        the same ``(engine, rank)`` first fences the old one as :meth:`remove_peer` does, with
        reason ``stale_generation``.

        Raises :class:`IncompatiblePeerError` when the record does not fit the local pool, and a
        :class:`TransferError` when the agent cannot be reached (it may already be dead).
        """

    @abstractmethod
    def remove_peer(
        self, engine_id: EngineId, rank: RankKey | None = None, *, reason: str = "peer_removed"
    ) -> None:
        """Forget a producer worker (or every worker of ``engine_id`` when ``rank`` is None).

        Pending pulls reading from it end, at the next :meth:`poll`, with failures of
        ``reason`` naming their blocks; their transfers are aborted first. Unknown peers are
        ignored. Never raises for NIXL trouble on the way out (it is logged).
        """

    @abstractmethod
    def peer_generation(self, engine_id: EngineId, rank: RankKey) -> Generation | None:
        """The generation of the added peer, or None when none was added."""

    @abstractmethod
    def start_pull(self, spec: PullSpec) -> None:
        """Issue the reads of ``spec`` (step 4) and return without waiting for data.

        Reads whose peer is unknown or of another generation than
        ``spec.producer_generation`` are not issued: they end as failures (``unknown_peer``,
        ``stale_generation``) at the next :meth:`poll`, as do reads NIXL refuses. Raises
        :class:`PullSpecError` when the spec itself is wrong (block counts differ, ids out of
        range or not allocated, reads that are not this worker's or do not match the peer's
        prepared slice, a pull already pending for the same request and engine).
        """

    @abstractmethod
    def cancel_pull(self, request_id: RequestId, producer_engine: EngineId) -> bool:
        """Abort a pending pull; it ends at the next :meth:`poll` with reason ``cancelled``.
        Returns False when no such pull is pending."""

    @abstractmethod
    def poll(self) -> list[PullResult]:
        """Progress pending pulls; return those that ended since the last call (step 5).

        Each pull is returned exactly once. Reads past their deadline are aborted
        (``timeout``). Notifications to producers are sent here, and every call progresses
        their delivery, also with no pull pending; notifications this worker receives meanwhile
        wait for :meth:`poll_notifications`.
        """

    @abstractmethod
    def pending_pulls(self) -> int:
        """Pulls started and not yet returned by :meth:`poll`."""

    @abstractmethod
    def poll_notifications(self) -> Notifications:
        """The completion notifications that arrived for this (producer) worker (step 8)."""

    @abstractmethod
    def close(self) -> None:
        """Abort pending pulls, forget peers, deregister the pool. Idempotent."""
