"""The worker side of pdserve's vLLM connectors (every rank): remote handshakes resolved from
the control plane and pre-warmed, departed peer generations invalidated
(:class:`WorkerHandshake`), and vLLM's push and pull workers on top of it (the pull worker reads
along pdserve's transfer plan, :mod:`._planned_pull`). Imports vLLM: loaded by
:mod:`._connector_impl`."""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPullConnectorWorker,
    NixlPushConnectorWorker,
)
from vllm.distributed.parallel_state import get_pp_group
from vllm.platforms import current_platform

from services.control_plane.base import EngineView
from services.control_plane.errors import ControlPlaneError
from services.control_plane.wire import EngineId, EngineRole
from services.engines.vllm._planned_pull import PlannedPullWorker, remote_agent_metadata
from services.engines.vllm.contracts import FinishedOnce
from services.engines.vllm.handshake import (
    ConnectorSettings,
    HandshakeResolutionError,
    now_clocks,
    parse_vllm_engine_id,
    vllm_engine_id,
)
from services.engines.vllm.layouts import (
    KVRole,
    TransferMode,
    UnsupportedVllmLayout,
    VllmLayout,
    check_pair,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
from services.engines.vllm._connector_common import (
    CONTROL_PLANE_HOST,
    ControlPlaneClient,
    model_geometry,
)

logger = logging.getLogger(__name__)


class WorkerHandshake(ControlPlaneClient):
    """Worker-side mixin: resolve remote handshakes from the control plane, pre-warmed."""

    vllm_config: VllmConfig
    pdserve_layout: VllmLayout

    def _pdserve_init(self, settings: ConnectorSettings, layout: VllmLayout) -> None:
        self.pdserve = settings
        self.pdserve_layout = layout
        self._bridge = None
        self._peer_generations: dict[EngineId, str] = {}
        self._peer_lock = threading.Lock()
        self._stale_peers: queue.SimpleQueue[str] = queue.SimpleQueue()
        """Peer generations gone from the control plane, invalidated on vLLM's main thread."""
        self.finished_once = FinishedOnce()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)  # type: ignore[misc]
        # Local descriptors exist now: peers can be handshaken as they turn READY.
        self.bridge().follow(self._on_peer_change)

    # -- main-thread hooks -------------------------------------------------------------------
    # The watcher calls back on the bridge thread; vLLM's remote-engine bookkeeping (invalid
    # peers, TTL eviction) is iterated on the main thread without a lock. Invalidations are
    # therefore queued and applied here, on the main thread, before vLLM's own step work.
    # Pre-warm handshakes start from the bridge thread (as vLLM's push writer thread starts
    # its own): everything _ensure_handshake touches is under vLLM's _handshake_lock except
    # the TTL eviction, which is left to vLLM's own callers (_evict_stale_engines below).
    def _apply_peer_changes(self) -> None:
        while True:
            try:
                stale_engine = self._stale_peers.get_nowait()
            except queue.Empty:
                return
            self._invalidate(stale_engine)

    def start_load_kv(self, metadata: Any) -> None:
        self._apply_peer_changes()
        super().start_load_kv(metadata)  # type: ignore[misc]

    def get_transfer_results(self) -> KVConnectorTransferResults:
        self._apply_peer_changes()
        results: KVConnectorTransferResults = super().get_transfer_results()  # type: ignore[misc]
        return results

    def _evict_stale_engines(self) -> None:
        if self._bridge is not None and self._bridge.on_loop_thread():
            return  # a pre-warm: eviction mutates unlocked state; vLLM's next handshake evicts
        super()._evict_stale_engines()  # type: ignore[misc]

    # -- pre-warm ---------------------------------------------------------------------------
    def _wanted_peer(self, view: EngineView) -> tuple[VllmLayout, bool] | None:
        """The peer's layout and whether we only exchange notifications with it, or None
        (not a vLLM peer of the same model and KV geometry: the router never pairs those, and
        their handshake would fail)."""
        record = view.record
        if (
            record is None
            or record.engine_kind != "vllm"
            or record.engine_id == self.pdserve.engine_id
            or (
                self.pdserve.compat_hash is not None
                and record.compat_hash != self.pdserve.compat_hash
            )
        ):
            return None
        own = self.pdserve_layout
        peer_is_producer = record.role in (EngineRole.PREFILL, EngineRole.BOTH)
        peer_is_consumer = record.role in (EngineRole.DECODE, EngineRole.BOTH)
        if own.role is not KVRole.PRODUCER and peer_is_producer:
            peer_role, notif_only = KVRole.PRODUCER, own.mode is TransferMode.PUSH
        elif own.role is not KVRole.CONSUMER and peer_is_consumer and own.mode is TransferMode.PUSH:
            peer_role, notif_only = KVRole.CONSUMER, False
        else:
            return None
        # The record does not carry the peer's transfer mode (its handshake extras do): a peer
        # of the other mode is refused when its handshake is resolved (resolve_extras).
        peer = VllmLayout(peer_role, own.mode, record.pp_size, record.tp_size)
        return peer, notif_only

    def _on_peer_change(self, view: EngineView | None, engine_id: EngineId) -> None:
        with self._peer_lock:
            previous = self._peer_generations.get(engine_id)
            current = (
                vllm_engine_id(engine_id, view.generation)
                if view is not None and view.ready and view.generation is not None
                else None
            )
            if previous is not None and previous != current:
                del self._peer_generations[engine_id]
                self._stale_peers.put(previous)  # applied on the main thread
            if current is None or current == previous or view is None:
                return
            wanted = self._wanted_peer(view)
            if wanted is None:
                return
            peer, notif_only = wanted
            own = self.pdserve_layout
            producer, consumer = (peer, own) if peer.role is KVRole.PRODUCER else (own, peer)
            try:
                check_pair(
                    producer,
                    consumer,
                    num_kv_heads=self.vllm_config.model_config.get_total_num_kv_heads(),
                )
            except UnsupportedVllmLayout as exc:
                # Logged only: vLLM's worker processes export no pdserve metrics registry.
                logger.error("not pre-warming %s: %s", current, exc)
                return
            self._peer_generations[engine_id] = current
        logger.info(
            "pre-warming NIXL handshake with %s (PP=%d TP=%d)", current, peer.pp_size, peer.tp_size
        )
        self._ensure_handshake(  # type: ignore[attr-defined]
            current,
            CONTROL_PLANE_HOST,
            0,
            peer.tp_size,
            1,
            peer.pp_size if peer.role is KVRole.PRODUCER else 1,
            notif_only,
        )

    def _track_remote_engine_replacement(self, engine_id: str, host: str, port: int) -> None:
        """Key vLLM's pull-mode replacement tracking by pdserve engine, not by address.

        vLLM keeps one NIXL engine per ``(host, port)`` and releases the others once their reads
        drain; every pdserve peer has the same address (:data:`CONTROL_PLANE_HOST`, port 0), so
        each pre-warmed peer would release the one before. Keyed by ``(engine_id, 0)`` instead,
        only an older generation of the same pdserve engine is replaced."""
        try:
            key = (parse_vllm_engine_id(engine_id)[0], 0)
        except HandshakeResolutionError:
            key = (host, port)  # not a pdserve id (its handshake fails anyway): vLLM's keying
        super()._track_remote_engine_replacement(engine_id, *key)  # type: ignore[misc]

    def _invalidate(self, stale_engine: str) -> None:
        """A peer generation is gone: its reads fail fast and its agents are released (main
        thread only)."""
        if stale_engine in self._remote_agents:  # type: ignore[attr-defined]
            logger.warning("peer %s left the control plane; invalidating its agents", stale_engine)
            self._mark_remote_engine_invalid(stale_engine, time.perf_counter())  # type: ignore[attr-defined]

    # -- resolution (replaces the ZMQ side channel) ----------------------------------------
    def _nixl_handshake(
        self,
        host: str,
        port: int,
        remote_tp_size: int,
        expected_engine_id: str,
        remote_dcp_size: int = 1,
        remote_pp_size: int = 1,
        notif_agents_only: bool = False,
    ) -> tuple[dict[tuple[int, int], str], float]:
        """vLLM's handshake with the payloads read from the control plane."""
        worker: Any = self
        if worker._is_csa_linear:
            worker._validate_csa_linear_tp_layout(remote_tp_size)
        if not worker.use_host_buffer:
            current_platform.set_device(worker.device_id)
        if isinstance(self, PlannedPullWorker):
            engine_id, _generation = parse_vllm_engine_id(expected_engine_id)
            try:
                topology = self.bridge().topology(engine_id)
            except ControlPlaneError as exc:
                raise HandshakeResolutionError(f"{expected_engine_id}: {exc}") from exc
            return self.planned_handshake(
                topology,
                expected_engine_id,
                remote_pp_size=remote_pp_size,
                remote_tp_size=remote_tp_size,
            )
        targets = worker.transfer_topo.handshake_target_ranks(remote_tp_size, remote_dcp_size)
        extras = self.bridge().resolve(
            expected_engine_id,
            remote_pp_size=remote_pp_size,
            remote_tp_size=remote_tp_size,
            tp_ranks=list(targets),
            expected_mode=self.pdserve.transfer_mode,
        )
        names: dict[tuple[int, int], str] = {}
        offset = 0.0
        for (pp_rank, tp_rank), extra in sorted(extras.items()):
            meta = remote_agent_metadata(worker, extra.nixl_payload, expected_engine_id)
            if notif_agents_only:
                name = worker._add_notif_only_remote_agent(meta, remote_tp_size, meta.dcp_size)
            else:
                name = worker.add_remote_agent(meta, tp_rank, remote_tp_size, meta.dcp_size)
            names[(pp_rank, tp_rank)] = name
            perf, wall = now_clocks()
            offset = extra.clock_offset(now_perf=perf, now_wall=wall)
        return names, offset


class PushWorker(WorkerHandshake, NixlPushConnectorWorker):
    pass


class PullWorker(PlannedPullWorker, WorkerHandshake, NixlPullConnectorWorker):
    """vLLM's pull worker reading along pdserve's transfer plan (:mod:`._planned_pull`)."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        role = transfer.kv_role
        # NixlBaseConnectorWorker.__init__ refuses a kv_consumer with PP > 1: vLLM's own reads
        # are keyed by TP rank only. This worker's reads follow pdserve's plan, each PP stage
        # reading its own layers, so the refusal does not apply; it is the only use of kv_role
        # in that constructor, and the role is restored before anything else reads it.
        if role == KVRole.CONSUMER.value and vllm_config.parallel_config.pipeline_parallel_size > 1:
            transfer.kv_role = KVRole.BOTH.value
        try:
            super().__init__(vllm_config, engine_id, kv_cache_config)
        finally:
            transfer.kv_role = role

    def _pdserve_init(self, settings: ConnectorSettings, layout: VllmLayout) -> None:
        super()._pdserve_init(settings, layout)
        self.planned_init(model_geometry(self.vllm_config), get_pp_group().rank_in_group)
