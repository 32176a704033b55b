"""The NIXL implementation of :class:`~services.kv_transfer.transport.KVTransport`.

One NIXL agent per worker (:class:`~services.kv_transfer.nixl_agent.NixlAgent`, the only code
that calls NIXL); the pool's whole buffer is registered once. Per peer (a producer worker),
:meth:`NixlTransport.add_peer` adds the remote agent, starts connecting to it and prepares two
descriptor lists with :func:`~services.kv_transfer.descriptors.slice_descriptors`: the remote one
over the layers and heads this worker reads from that peer, the local one over all local layers
cut to the same heads (shared by every peer with that head slice). A request then costs two
index computations and one ``make_prepped_xfer`` per peer; nothing is validated or built per
descriptor on the request path.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

from services.control_plane.aggregation import geometry_errors
from services.control_plane.wire import EngineId, Generation, HandshakeRecord
from services.kv_transfer.allocator import BlockArray, block_array
from services.kv_transfer.block_pool import KV_LAYOUT, KVBlockPool
from services.kv_transfer.descriptors import RegionGeometry, slice_descriptors, slice_indices
from services.kv_transfer.errors import (
    IncompatiblePeerError,
    NotificationDecodeError,
    PullSpecError,
    StaleGenerationError,
    TransferError,
    TransferTimeoutError,
    TransportFatalError,
    UnknownPeerError,
)
from services.kv_transfer.nixl_agent import Handle, NixlAgent, NixlConfig
from services.kv_transfer.protocol import (
    KVNotification,
    RequestId,
    WorkerIdentity,
    decode_notification,
    encode_notification,
    rank_label,
)
from services.kv_transfer.pulls import PeerKey, PullState, ReadState
from services.kv_transfer.transport import (
    KVTransport,
    Notifications,
    PullResult,
    PullSpec,
)
from services.topology import Range
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)

INBOX_LIMIT = 4096
"""Notifications :meth:`NixlTransport.poll` keeps (it progresses the agent) until the next
:meth:`NixlTransport.poll_notifications`; beyond it they are dropped and reported rejected."""


@dataclass
class _Peer:
    key: PeerKey
    record: HandshakeRecord
    agent: str
    layers: Range | None
    """Global layers read from this peer (its layers within ours); None when disjoint."""
    heads: Range | None
    remote_dlist: Handle = None
    local_dlist: Handle = None


class NixlTransport(KVTransport):
    """A :class:`KVTransport` over one NIXL agent. Not thread-safe."""

    def __init__(
        self,
        pool: KVBlockPool,
        identity: WorkerIdentity,
        *,
        agent_name: str | None = None,
        config: NixlConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._identity = identity
        self._config = config or NixlConfig()
        self._clock = clock
        self._name = agent_name or (
            f"{identity.engine_id}-g{identity.generation}-{identity.label}-{uuid.uuid4().hex[:8]}"
        )
        self._local = pool.geometry()
        self._agent = NixlAgent(self._name, self._config, pool.buffer)
        self._peers: dict[PeerKey, _Peer] = {}
        self._local_dlists: dict[Range, Handle] = {}
        self._pulls: dict[tuple[EngineId, RequestId], PullState] = {}
        self._inbox: list[tuple[str, bytes]] = []
        self._inbox_dropped = 0
        self._closed = False

    # -- identity ------------------------------------------------------------------------------

    @property
    def identity(self) -> WorkerIdentity:
        return self._identity

    @property
    def pool(self) -> KVBlockPool:
        return self._pool

    @property
    def agent_name(self) -> str:
        return self._name

    def agent_metadata(self) -> bytes:
        self._check_open()
        return self._agent.metadata()

    # -- peers ---------------------------------------------------------------------------------

    def add_peer(self, record: HandshakeRecord) -> None:
        self._check_open()
        key: PeerKey = (record.engine_id, (record.pp_rank, record.tp_rank))
        existing = self._peers.get(key)
        if existing is not None:
            if (existing.record.generation, existing.record.agent_name) == (
                record.generation,
                record.agent_name,
            ):
                return
            reason = (
                "stale_generation"
                if existing.record.generation != record.generation
                else "peer_replaced"
            )
            self._drop_peer(existing, reason)
        self._check_compatible(record)
        where = f"{record.engine_id}@{record.generation} {rank_label(key[1])}"
        agent = self._agent.add_remote(record.agent_metadata)
        peer = _Peer(
            key,
            record,
            agent,
            record.layers.intersect(self._local.layers),
            record.kv_heads.intersect(self._local.kv_heads),
        )
        try:
            if peer.layers is not None and peer.heads is not None:
                rows = slice_descriptors(RegionGeometry.of(record), peer.layers, peer.heads)
                try:
                    peer.remote_dlist = self._agent.prep_dlist(agent, rows, record.memory_type)
                except TransferError as exc:
                    # NIXL checks remote descriptors against the memory the peer registered
                    # (from its agent metadata): a record pointing elsewhere fails here,
                    # before any read.
                    raise IncompatiblePeerError(
                        f"peer {where}: its regions are not inside the memory it registered "
                        f"with NIXL ({exc})",
                        reason="outside_registered_memory",
                    ) from exc
                peer.local_dlist = self._local_dlist(peer.heads)
        except Exception:
            self._forget_agent(peer)
            raise
        self._peers[key] = peer
        logger.info(
            "KV peer %s added (agent %s, layers %s, heads %s)",
            where,
            agent,
            peer.layers,
            peer.heads,
        )

    def _check_compatible(self, record: HandshakeRecord) -> None:
        spec = self._pool.spec
        mine = (spec.dtype, spec.head_size, spec.block_size, KV_LAYOUT)
        theirs = (record.dtype, record.head_size, record.block_size, record.kv_layout)
        rank = (record.pp_rank, record.tp_rank)
        if mine != theirs:
            raise IncompatiblePeerError(
                f"peer {record.engine_id} {rank_label(rank)} has "
                f"(dtype, head_size, block_size, layout) {theirs}, this pool {mine}"
            )
        # Records normally arrive re-validated by the control plane; checked again here
        # because a hostile geometry would make this process build descriptors of arbitrary
        # size and addresses. With dtype, head size and block size equal to this pool's, its
        # block_len check is this pool's (heads x head_bytes).
        problems = geometry_errors(record)
        if problems:
            raise IncompatiblePeerError(
                f"peer {record.engine_id} {rank_label(rank)} has an unsafe "
                f"region geometry: {'; '.join(problems)}",
                reason="geometry",
            )

    def _local_dlist(self, heads: Range) -> Handle:
        handle = self._local_dlists.get(heads)
        if handle is None:
            rows = slice_descriptors(self._local, self._local.layers, heads)
            handle = self._agent.prep_dlist(None, rows, self._local.memory_type)
            self._local_dlists[heads] = handle
        return handle

    def remove_peer(
        self, engine_id: EngineId, rank: RankKey | None = None, *, reason: str = "peer_removed"
    ) -> None:
        for key, peer in list(self._peers.items()):
            if key[0] == engine_id and (rank is None or key[1] == rank):
                self._drop_peer(peer, reason)

    def peer_generation(self, engine_id: EngineId, rank: RankKey) -> Generation | None:
        peer = self._peers.get((engine_id, rank))
        return None if peer is None else peer.record.generation

    def _drop_peer(self, peer: _Peer, reason: str) -> None:
        for pull in self._pulls.values():
            for read in pull.reads:
                if read.peer == peer.key and not read.done:
                    self._end_read(
                        read, reason, f"peer {peer.record.agent_name} removed ({reason})"
                    )
        self._peers.pop(peer.key, None)
        self._forget_agent(peer)
        logger.info("KV peer %s %s dropped: %s", peer.key[0], rank_label(peer.key[1]), reason)

    def _forget_agent(self, peer: _Peer) -> None:
        try:
            if peer.remote_dlist is not None:
                handle, peer.remote_dlist = peer.remote_dlist, None
                self._agent.release(handle)
            self._agent.remove_remote(peer.agent)
        except TransferError as exc:
            logger.warning("KV peer %s: %s", peer.agent, exc)

    # -- pulls ---------------------------------------------------------------------------------

    def start_pull(self, spec: PullSpec) -> None:
        self._check_open()
        started = time.perf_counter()
        key = (spec.producer_engine, spec.request_id)
        if key in self._pulls:
            raise PullSpecError(f"a pull of {spec.request_id} from {key[0]} is already pending")
        local, remote = self._check_spec(spec)
        now = self._clock()
        pull = PullState(spec, now, now + spec.timeout_s)
        for planned in spec.reads:
            peer_key: PeerKey = (spec.producer_engine, (planned.remote_pp, planned.remote_tp))
            read = ReadState(planned, peer_key, local, remote)
            pull.reads.append(read)
            peer = self._peers.get(peer_key)
            if peer is None:
                self._end_read(read, UnknownPeerError.reason, "no peer added for this rank")
            elif peer.record.generation != spec.producer_generation:
                self._end_read(
                    read,
                    StaleGenerationError.reason,
                    f"request of generation {spec.producer_generation}, peer is at "
                    f"{peer.record.generation}",
                )
        pull.setup_seconds = time.perf_counter() - started
        for read in pull.reads:
            if not read.done:
                self._post(read, self._peers[read.peer])
        self._pulls[key] = pull

    def _check_spec(self, spec: PullSpec) -> tuple[BlockArray, BlockArray]:
        """Validate ``spec``; its block ids as arrays (converted once per pull)."""
        local = block_array(spec.local_block_ids)
        remote = block_array(spec.remote_block_ids)
        if local.size != remote.size:
            raise PullSpecError(f"{local.size} local blocks for {remote.size} remote")
        if not self._pool.allocator.all_allocated(local):
            raise PullSpecError("local block ids out of range or not allocated")
        remote_max = int(remote.max()) if remote.size else -1
        if remote.size and int(remote.min()) < 0:
            raise PullSpecError("negative remote block ids")
        shard = self._pool.spec.shard
        for planned in spec.reads:
            if planned.local_shard != shard:
                raise PullSpecError(f"read planned for shard {planned.local_shard}, not {shard}")
            peer = self._peers.get((spec.producer_engine, (planned.remote_pp, planned.remote_tp)))
            if peer is None or peer.record.generation != spec.producer_generation:
                continue  # reported as data: unknown_peer / stale_generation
            if (
                peer.layers is None
                or planned.layers.intersect(peer.layers) != planned.layers
                or planned.kv_heads != peer.heads
            ):
                raise PullSpecError(
                    f"read of layers {planned.layers} heads {planned.kv_heads} does not match the "
                    f"slice prepared for {rank_label(peer.key[1])}: {peer.layers} x {peer.heads}"
                )
            if remote_max >= peer.record.num_blocks:
                raise PullSpecError(f"remote block ids outside [0, {peer.record.num_blocks})")
        return local, remote

    def _prepare(self, read: ReadState, peer: _Peer) -> Handle:
        """The read's transfer request: index arithmetic plus ``make_prepped_xfer``."""
        assert peer.layers is not None  # checked by _check_spec
        planned = read.read
        local_idx = slice_indices(
            self._local.layers, planned.layers, self._local.num_blocks, read.local_ids
        )
        remote_idx = slice_indices(
            peer.layers, planned.layers, peer.record.num_blocks, read.remote_ids
        )
        return self._agent.read(peer.local_dlist, local_idx, peer.remote_dlist, remote_idx)

    def _post(self, read: ReadState, peer: _Peer) -> None:
        planned = read.read
        n_blocks = len(read.local_ids)
        read.nbytes = 2 * len(planned.layers) * n_blocks * self._local.slice_bytes(planned.kv_heads)
        read.descriptors = 2 * len(planned.layers) * n_blocks
        if n_blocks == 0:
            read.done = True
            return
        started = time.perf_counter()
        try:
            read.handle = self._prepare(read, peer)
            read.prep_seconds = time.perf_counter() - started
            read.posted_at = self._clock()
            state = self._agent.post(read.handle)
        except TransferError as exc:
            self._end_read(read, exc.reason, str(exc))
            return
        self._on_state(read, state)

    def descriptor_cost(self, spec: PullSpec, repeats: int = 20) -> float:
        """Median seconds to validate ``spec`` and build (not post) its transfer requests.

        A diagnostic for benchmarks: the per-request descriptor overhead in steady state,
        without the wake-ups and cache misses that surround a real request.
        """
        self._check_open()
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            local, remote = self._check_spec(spec)
            handles = []
            for planned in spec.reads:
                key: PeerKey = (spec.producer_engine, (planned.remote_pp, planned.remote_tp))
                peer = self._peers.get(key)
                if peer is not None and len(local):
                    handles.append(self._prepare(ReadState(planned, key, local, remote), peer))
            samples.append(time.perf_counter() - started)
            for handle in handles:
                self._agent.release(handle)
        return sorted(samples)[len(samples) // 2]

    def _on_state(self, read: ReadState, state: str) -> None:
        if state == "DONE":
            read.done = True
            read.completed_at = self._clock()
            self._release(read)
        elif state == "ERR":
            self._end_read(read, "transfer_error", "NIXL reported the transfer failed")

    def _end_read(self, read: ReadState, reason: str, message: str) -> None:
        """End a read as failed, aborting its transfer when in flight."""
        read.fail(reason, message)
        self._release(read)

    def _release(self, read: ReadState) -> None:
        if read.handle is None:
            return
        handle, read.handle = read.handle, None
        try:
            self._agent.release(handle)
        except TransferError as exc:
            # NIXL keeps the handle on its own leak list and retries when the agent goes away.
            logger.warning("KV read of %s: could not release its transfer: %s", read.peer, exc)

    def cancel_pull(self, request_id: RequestId, producer_engine: EngineId) -> bool:
        pull = self._pulls.get((producer_engine, request_id))
        if pull is None:
            return False
        for read in pull.reads:
            if not read.done:
                self._end_read(read, "cancelled", "pull cancelled by the consumer")
        return True

    def pending_pulls(self) -> int:
        return len(self._pulls)

    def poll(self) -> list[PullResult]:
        self._check_open()
        self._progress()
        now = self._clock()
        results: list[PullResult] = []
        for key, pull in list(self._pulls.items()):
            for read in pull.reads:
                if read.done:
                    continue
                try:
                    state = self._agent.state(read.handle)
                except TransferError as exc:
                    self._end_read(read, exc.reason, str(exc))
                    continue
                if state == "PROC" and now >= pull.deadline:
                    self._end_read(
                        read,
                        TransferTimeoutError.reason,
                        f"not complete after {pull.spec.timeout_s:.3f} s",
                    )
                else:
                    self._on_state(read, state)
            self._notify(pull)
            if pull.done:
                del self._pulls[key]
                results.append(pull.result(self._clock()))
        return results

    def _progress(self) -> None:
        """Progress the agent once, keeping what arrives for :meth:`poll_notifications`.

        A notice sent as a pull ends may wait in UCX until the connection to its producer is set
        up (a replica nobody read was only connected, never read from), and UCX moves it only
        while this agent progresses. Checking reads progresses it while pulls are pending; after
        the last one this call does (the notification fetch is the one NIXL call that progresses
        without a transfer handle), so a consumer with nothing left to read still delivers.
        """
        for sender, messages in self._agent.notifications().items():
            for message in messages:
                if len(self._inbox) < INBOX_LIMIT:
                    self._inbox.append((sender, message))
                else:
                    self._inbox_dropped += 1

    def _notify(self, pull: PullState) -> None:
        for rank, ok in pull.due_notifications():
            peer = self._peers.get((pull.spec.producer_engine, rank))
            if peer is None or peer.record.generation != pull.spec.producer_generation:
                pull.unnotified.append(rank)  # removed or replaced since the read completed
                continue
            notification = KVNotification(
                request_id=pull.spec.request_id,
                consumer_engine=self._identity.engine_id,
                consumer_generation=self._identity.generation,
                consumer_rank=self._identity.rank,
                expected_notifiers=pull.spec.notifiers.get(rank, 1),
                ok=ok,
            )
            try:
                self._agent.notify(peer.agent, encode_notification(notification))
            except TransferError as exc:
                logger.warning(
                    "KV notification of %s to %s failed: %s", pull.spec.request_id, peer.agent, exc
                )
                pull.unnotified.append(rank)

    # -- producer side -------------------------------------------------------------------------

    def poll_notifications(self) -> Notifications:
        self._check_open()
        arrived = self._agent.notifications()
        inbox, self._inbox = self._inbox, []
        inbox.extend((sender, message) for sender, got in arrived.items() for message in got)
        received: list[KVNotification] = []
        rejected: list[str] = []
        for sender, message in inbox:
            try:
                received.append(decode_notification(message))
            except NotificationDecodeError as exc:  # a remote agent is a trust boundary
                rejected.append(f"from {sender[:64]!r}: {exc}")
        if self._inbox_dropped:
            rejected.append(
                f"{self._inbox_dropped} notifications dropped: more than {INBOX_LIMIT} "
                "arrived between two polls of them"
            )
            self._inbox_dropped = 0
        return Notifications(tuple(received), tuple(rejected))

    # -- shutdown ------------------------------------------------------------------------------

    def close(self) -> None:
        if self._closed:
            return
        for pull in self._pulls.values():
            for read in pull.reads:
                if not read.done:
                    self._end_read(read, "closed", "transport closed")
        self._pulls.clear()
        for peer in list(self._peers.values()):
            self._drop_peer(peer, "closed")
        try:
            for handle in self._local_dlists.values():
                self._agent.release(handle)
            self._local_dlists.clear()
            self._agent.deregister()
        except TransferError as exc:
            logger.warning("KV transport %s close: %s", self._name, exc)
        self._closed = True

    def _check_open(self) -> None:
        if self._closed:
            raise TransportFatalError(f"KV transport {self._name} is closed")


__all__ = ["NixlConfig", "NixlTransport"]
