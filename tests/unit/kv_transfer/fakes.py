"""A scripted in-memory KVTransport for unit tests of the consumer and producer state machines."""

from __future__ import annotations

from services.control_plane.wire import EngineId, Generation, HandshakeRecord
from services.kv_transfer.block_pool import KVBlockPool
from services.kv_transfer.protocol import KVNotification, RequestId, WorkerIdentity
from services.kv_transfer.transport import KVTransport, Notifications, PullResult, PullSpec
from services.topology.ranges import RankKey


class FakeTransport(KVTransport):
    """Records calls; ``results`` and ``inbox`` are what the next polls return."""

    def __init__(self, pool: KVBlockPool, identity: WorkerIdentity) -> None:
        self._pool = pool
        self._identity = identity
        self.peers: dict[tuple[EngineId, RankKey], HandshakeRecord] = {}
        self.removed: list[tuple[EngineId, RankKey | None, str]] = []
        self.started: list[PullSpec] = []
        self.results: list[PullResult] = []
        self.inbox: list[KVNotification] = []
        self.rejected: list[str] = []

    @property
    def identity(self) -> WorkerIdentity:
        return self._identity

    @property
    def pool(self) -> KVBlockPool:
        return self._pool

    @property
    def agent_name(self) -> str:
        return f"fake-{self._identity.label}"

    def agent_metadata(self) -> bytes:
        return b"fake-metadata"

    def add_peer(self, record: HandshakeRecord) -> None:
        self.peers[(record.engine_id, (record.pp_rank, record.tp_rank))] = record

    def remove_peer(
        self, engine_id: EngineId, rank: RankKey | None = None, *, reason: str = "peer_removed"
    ) -> None:
        self.removed.append((engine_id, rank, reason))
        for key in [k for k in self.peers if k[0] == engine_id and rank in (None, k[1])]:
            del self.peers[key]

    def peer_generation(self, engine_id: EngineId, rank: RankKey) -> Generation | None:
        record = self.peers.get((engine_id, rank))
        return None if record is None else record.generation

    def start_pull(self, spec: PullSpec) -> None:
        self.started.append(spec)

    def cancel_pull(self, request_id: RequestId, producer_engine: EngineId) -> bool:
        return False

    def poll(self) -> list[PullResult]:
        results, self.results = self.results, []
        return results

    def pending_pulls(self) -> int:
        return len(self.started)

    def poll_notifications(self) -> Notifications:
        inbox, self.inbox = self.inbox, []
        rejected, self.rejected = self.rejected, []
        return Notifications(tuple(inbox), tuple(rejected))

    def close(self) -> None:
        pass
