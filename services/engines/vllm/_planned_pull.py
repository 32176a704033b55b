"""Pull-mode reads along pdserve's transfer plan, inside vLLM 0.32.0's NIXL pull worker.

Imports vLLM: loaded only by :mod:`services.engines.vllm._connector_worker`.

vLLM's pull worker reads by TP ratio (``tp_mapping.compute_tp_mapping``, one agent per remote
TP rank, ``(0, tp_rank)``): no PP-sharded producer, no PP consumer. :class:`PlannedPullWorker`
replaces exactly two of its steps and keeps the rest (request bookkeeping, completion polling,
failure reporting, leases, heartbeats, stats):

- *handshake* (:meth:`PlannedPullWorker.planned_handshake`, called from the control-plane
  resolution): the producer's READY records give every rank's layer and KV-head range;
  :func:`~services.engines.vllm.transfer_plan.plan_rank` says which producer ranks this rank
  reads (its layers only, on a PP consumer) and which it only notifies; their agents are added
  and one descriptor-list pair per read is prepared, once per peer generation;
- *reads* (:meth:`PlannedPullWorker._read_blocks_for_req`): per request, one NIXL READ per
  planned read, selecting the request's blocks by index, each carrying the notification
  ``"<request>:<count>"`` vLLM's producer counts (``NixlPullConnectorWorker._get_new_notifs``
  frees a request on each producer rank once ``count`` notifications arrived; ``count`` is how
  many consumer ranks notify that producer rank, from the plan); replicas nobody reads get the
  same notification by message, so they free at once instead of at lease expiry.

Each worker still reports each request once (vLLM's ``_recving_transfers`` holds all its reads),
so ``KVOutputAggregator`` sees every PP x TP worker of the consumer, as it expects.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec
from vllm.distributed.kv_transfer.kv_connector.utils import EngineTransferInfo
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlAgentMetadata,
    NixlHandshakePayload,
)

from services.control_plane.aggregation import EngineTopology
from services.engines.vllm.handshake import (
    HandshakeResolutionError,
    now_clocks,
    resolve_extras,
)
from services.engines.vllm.layouts import TransferMode, UnsupportedVllmLayout, vllm_layer_ranges
from services.engines.vllm.transfer_plan import (
    RankRead,
    RankTransferPlan,
    consumer_layout,
    plan_rank,
)
from services.kv_transfer.descriptors import RegionGeometry
from services.topology import EngineLayout, ModelShape
from services.topology.errors import LayoutError
from services.topology.ranges import RankKey

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedPeer:
    """One producer engine generation as this consumer rank reads it."""

    plan: RankTransferPlan
    agents: dict[RankKey, str]
    handles: tuple[tuple[RankRead, int, int], ...]
    """Per read: the read, its local and its remote prepared descriptor-list handle."""


def remote_agent_metadata(
    worker: Any, nixl_payload: bytes, expected_engine_id: str
) -> NixlAgentMetadata:
    """A remote rank's NIXL agent metadata from its published vLLM payload, checked as vLLM's
    own handshake checks it: compatibility hash (unless the worker does not enforce it), parallel
    config, and the engine id it was published under."""
    payload = msgspec.msgpack.Decoder(NixlHandshakePayload).decode(nixl_payload)
    if worker.enforce_compat_hash and payload.compatibility_hash != worker.compat_hash:
        raise HandshakeResolutionError(
            f"NIXL compatibility hash mismatch with {expected_engine_id}: local "
            f"{worker.compat_hash}, remote {payload.compatibility_hash}"
        )
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    worker._validate_remote_parallel_config(meta)
    if meta.engine_id != expected_engine_id:
        raise HandshakeResolutionError(
            f"payload of {meta.engine_id} published under {expected_engine_id}"
        )
    return meta


class PlannedPullWorker:
    """Mixin over vLLM's ``NixlPullConnectorWorker`` (listed before it): planned reads."""

    _pdserve_consumer: EngineLayout
    _pdserve_rank: RankKey
    _pdserve_peers: dict[str, PreparedPeer]
    _pdserve_local: RegionGeometry | None
    _pdserve_departed: set[str]
    _pdserve_notices: dict[str, dict[Any, tuple[PreparedPeer, RankKey, str, int]]]
    """Per request, each posted READ's notification (peer, producer rank, remote request,
    count), sent by hand should the READ fail; dropped once the request is reported."""

    def planned_init(self, shape: ModelShape, pp_rank: int) -> None:
        worker: Any = self
        self._pdserve_consumer = consumer_layout(
            vllm_layer_ranges(shape.num_layers, shape.pp_size, shape.layer_partition),
            shape.num_kv_heads,
            worker.vllm_config.parallel_config.tensor_parallel_size,
        )
        self._pdserve_rank = (pp_rank, worker.tp_rank)
        self._pdserve_peers = {}
        self._pdserve_local = None
        self._pdserve_notices = {}
        self._pdserve_departed = set()
        """Producer generations that left the control plane: one entry per departed generation
        over the engine's life (a generation never comes back, so their reads fail at once)."""

    def _local_geometry(self) -> RegionGeometry:
        """This rank's registered regions, as its own handshake payload describes them."""
        if self._pdserve_local is None:
            worker: Any = self
            payload = worker.xfer_handshake_metadata
            if payload is None:
                raise HandshakeResolutionError("the local KV caches are not registered yet")
            meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
            if meta.physical_blocks_per_logical_kv_block != 1:
                raise UnsupportedVllmLayout(
                    "the attention kernel splits each logical block; planned reads need one "
                    "physical block per logical block"
                )
            shard = self._pdserve_consumer.shards[self._pdserve_rank]
            regions = len(meta.kv_caches_base_addr)
            if regions % len(shard.layers) or regions // len(shard.layers) not in (1, 2):
                raise UnsupportedVllmLayout(
                    f"{regions} local KV regions for the {len(shard.layers)} layers {shard.layers}"
                )
            self._pdserve_local = RegionGeometry(
                base_addrs=tuple(meta.kv_caches_base_addr),
                layers=shard.layers,
                kv_heads=shard.kv_heads,
                num_blocks=meta.num_blocks,
                block_len=meta.block_lens[0],
                block_stride=meta.block_strides[0] if meta.block_strides else meta.block_lens[0],
                device_id=meta.device_id,
                memory_type=worker.nixl_memory_type,
                regions_per_layer=regions // len(shard.layers),
            )
        return self._pdserve_local

    # -- handshake --------------------------------------------------------------------------
    def planned_handshake(
        self,
        topology: EngineTopology,
        expected_engine_id: str,
        *,
        remote_pp_size: int,
        remote_tp_size: int,
    ) -> tuple[dict[RankKey, str], float]:
        """Add the agents this rank talks to and prepare its reads (vLLM's handshake thread)."""
        worker: Any = self
        extras = resolve_extras(
            topology,
            expected_engine_id,
            remote_pp_size=remote_pp_size,
            remote_tp_size=remote_tp_size,
            tp_ranks=list(range(remote_tp_size)),
            expected_mode=TransferMode.PULL,
        )
        try:
            plan = plan_rank(
                self._pdserve_rank, self._pdserve_consumer, topology.records, self._local_geometry()
            )
        except LayoutError as exc:
            raise HandshakeResolutionError(f"{expected_engine_id}: {exc}") from exc
        agents: dict[RankKey, str] = {}
        first_meta: NixlAgentMetadata | None = None
        for rank in plan.peers:
            meta = remote_agent_metadata(worker, extras[rank].nixl_payload, expected_engine_id)
            first_meta = first_meta or meta
            agents[rank] = worker.nixl_wrapper.add_remote_agent(meta.agent_metadata)
        assert first_meta is not None  # a plan reads or notifies at least one rank
        wrapper = worker.nixl_wrapper
        handles = []
        for read in plan.reads:
            local = wrapper.prep_xfer_dlist(
                "NIXL_INIT_AGENT", wrapper.get_xfer_descs(read.local_rows, plan.local.memory_type)
            )
            remote_geometry = plan.remote[read.remote_rank]
            remote = wrapper.prep_xfer_dlist(
                agents[read.remote_rank],
                wrapper.get_xfer_descs(read.remote_rows, remote_geometry.memory_type),
            )
            handles.append((read, local, remote))
        # vLLM's per-engine bookkeeping (expiry checks, cleanup) looks the engine up here.
        worker.transfer_topo.register_remote_engine(
            expected_engine_id,
            EngineTransferInfo(
                remote_tp_size=remote_tp_size,
                remote_block_size=first_meta.block_size,
                remote_block_len=first_meta.block_lens[0],
                remote_physical_blocks_per_logical=first_meta.physical_blocks_per_logical_kv_block,
                remote_dcp_size=1,
            ),
        )
        self._pdserve_peers[expected_engine_id] = PreparedPeer(plan, agents, tuple(handles))
        logger.info(
            "planned pull from %s for rank %s: %s; notify-only %s",
            expected_engine_id,
            self._pdserve_rank,
            ", ".join(
                f"{r.remote_rank} layers {r.read.layers} heads {r.read.kv_heads} "
                f"({len(r.local_rows)} descriptors, {r.notifiers} notifiers)"
                for r in plan.reads
            ),
            [rank for rank, _ in plan.notify_only],
        )
        perf, wall = now_clocks()
        offset = extras[plan.peers[0]].clock_offset(now_perf=perf, now_wall=wall)
        return agents, offset

    def _cleanup_remote_engine(self, engine_id: str, *, log_eviction: bool = True) -> None:
        """vLLM's cleanup, plus this rank's prepared descriptor lists of that peer."""
        worker: Any = self
        peer = self._pdserve_peers.pop(engine_id, None)
        if peer is not None:
            for _read, local, remote in peer.handles:
                worker.nixl_wrapper.release_dlist_handle(local)
                worker.nixl_wrapper.release_dlist_handle(remote)
        super()._cleanup_remote_engine(engine_id, log_eviction=log_eviction)  # type: ignore[misc]

    def _invalidate(self, stale_engine: str) -> None:
        """A producer generation left the control plane (main thread): remembered, then
        vLLM's invalidation (:class:`~._connector_worker.WorkerHandshake`)."""
        self._pdserve_departed.add(stale_engine)
        super()._invalidate(stale_engine)  # type: ignore[misc]

    # -- reads ------------------------------------------------------------------------------
    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        """Post this rank's planned READs of one request (vLLM's main thread)."""
        worker: Any = self
        engine_id = meta.remote.engine_id
        if engine_id in self._pdserve_departed or engine_id in worker._invalid_remote_engines:
            self._fail_unreadable(req_id, meta)
            return
        if engine_id not in worker._remote_agents:
            worker._background_nixl_handshake(req_id, engine_id, meta)
            return
        worker._engine_last_active[engine_id] = time.perf_counter()
        peer = self._pdserve_peers[engine_id]
        local_groups, remote_groups = meta.local_physical_block_ids, meta.remote.block_ids
        if len(local_groups) > 1 or len(remote_groups) != 1:
            raise UnsupportedVllmLayout(
                f"{len(remote_groups)} KV cache groups: planned reads serve one (full attention)"
            )
        # vLLM stages a full local hit with no group at all: an empty read.
        local_ids = list(local_groups[0]) if local_groups else []
        remote_ids = list(remote_groups[0])
        if len(local_ids) > len(remote_ids):
            raise UnsupportedVllmLayout(
                f"request {req_id}: {len(local_ids)} local blocks for {len(remote_ids)} remote"
            )
        # A local prefix hit: only the uncomputed tail moves (vLLM's _apply_prefix_caching).
        remote_ids = remote_ids[len(remote_ids) - len(local_ids) :]
        remote_request = meta.remote.request_id
        if not local_ids:
            # Full local hit: nothing to read, every producer rank we owe is told at once.
            for read in peer.plan.reads:
                self._notify(req_id, peer, read.remote_rank, remote_request, read.notifiers)
            if meta.awaiting_kvs:
                worker._recving_transfers.setdefault(req_id, [])
        else:
            worker._recving_transfers.setdefault(req_id, [])
            for index, (read, local_handle, remote_handle) in enumerate(peer.handles):
                if not self._post_read(
                    req_id, engine_id, read, local_handle, remote_handle, local_ids, remote_ids,
                    f"{remote_request}:{read.notifiers}".encode(), peer, remote_request,
                ):  # fmt: skip
                    # The request failed: no sibling read is posted, and the producer ranks of
                    # the failed and the unposted reads are told now, so they free the blocks
                    # at once instead of at lease expiry (vLLM's worker leaves them waiting).
                    for unread, _local, _remote in peer.handles[index:]:
                        self._notify(
                            req_id, peer, unread.remote_rank, remote_request, unread.notifiers
                        )
                    break
        for rank, count in peer.plan.notify_only:
            self._notify(req_id, peer, rank, remote_request, count)

    def _fail_unreadable(self, req_id: str, meta: Any) -> None:
        """The producer generation is gone: the request's reads fail now, named and counted
        (vLLM's own path fails them uncounted), and vLLM ends the request per its
        ``kv_load_failure_policy``."""
        worker: Any = self
        remote_blocks = [list(group) for group in meta.remote.block_ids]
        worker._log_failure(
            failure_type="producer_gone",
            req_id=req_id,
            msg=f"{meta.remote.engine_id} left the control plane before this rank's planned "
            f"reads of its blocks {remote_blocks} into local blocks "
            f"{[list(group) for group in meta.local_physical_block_ids]}",
            meta=meta,
            rank=self._pdserve_rank,
        )
        worker._handle_failed_transfer(req_id, None, worker._recv_failures)

    def _post_read(
        self,
        req_id: str,
        engine_id: str,
        read: RankRead,
        local_handle: int,
        remote_handle: int,
        local_ids: list[int],
        remote_ids: list[int],
        notif: bytes,
        peer: PreparedPeer,
        remote_request: str,
    ) -> bool:
        worker: Any = self
        handle = None
        try:
            local_idx, remote_idx = peer.plan.block_indices(read, local_ids, remote_ids)
            handle = worker.nixl_wrapper.make_prepped_xfer(
                "READ", local_handle, local_idx, remote_handle, remote_idx, notif_msg=notif
            )
            worker.nixl_wrapper.transfer(handle)
            worker._recving_transfers[req_id].append(handle)
            # Should this READ fail, its notification never reaches the producer: sent then.
            self._pdserve_notices.setdefault(req_id, {})[handle] = (
                peer, read.remote_rank, remote_request, read.notifiers
            )  # fmt: skip
            return True
        except Exception as e:
            worker._log_failure(
                failure_type="transfer_setup_failed",
                req_id=req_id,
                msg=f"planned read of layers {read.read.layers} heads {read.read.kv_heads} "
                f"blocks {local_ids} <- {remote_ids}",
                error=e,
                dst_engine_id=engine_id,
                remote_rank=read.remote_rank,
            )
            if not worker._handle_failed_transfer(req_id, handle, worker._recv_failures):
                worker._recving_transfers[req_id].append(handle)
            return False

    def _handle_failed_transfer(self, req_id: str, handle: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's failure bookkeeping; a planned READ that completed in error also tells its
        producer rank, which then frees the blocks at once (its READ's notification is lost)."""
        notice = self._pdserve_notices.get(req_id, {}).pop(handle, None)
        if notice is not None:
            self._notify(req_id, *notice)
        return super()._handle_failed_transfer(req_id, handle, *args, **kwargs)  # type: ignore[misc]

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results: KVConnectorTransferResults = super().get_transfer_results()  # type: ignore[misc]
        for req_id in results.finished_recving:
            self._pdserve_notices.pop(req_id, None)
        return results

    def _notify(
        self, req_id: str, peer: PreparedPeer, rank: RankKey, remote_request: str, count: int
    ) -> None:
        worker: Any = self
        agent = peer.agents[rank]
        try:
            worker.nixl_wrapper.send_notif(agent, notif_msg=f"{remote_request}:{count}".encode())
        except Exception as e:
            worker._log_failure(
                failure_type="notification_failed",
                msg="the producer rank frees the blocks at lease expiry",
                req_id=req_id,
                error=e,
                remote_rank=rank,
                remote_agent_name=agent,
            )
            worker.xfer_stats.record_failed_notification()


__all__ = ["PlannedPullWorker", "PreparedPeer"]
