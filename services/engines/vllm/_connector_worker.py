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

import msgspec
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlPullConnectorWorker,
    NixlPushConnectorWorker,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import PUSH_REG_NOTIF_PREFIX
from vllm.distributed.parallel_state import get_pp_group
from vllm.platforms import current_platform

from services.control_plane.base import EngineView
from services.control_plane.errors import ControlPlaneError
from services.control_plane.wire import EngineId, EngineRole
from services.engines.vllm._planned_pull import PlannedPullWorker, remote_agent_metadata
from services.engines.vllm.contracts import (
    PUSH_FAILED_KEY,
    RELEASE_KEY,
    FinishedOnce,
    no_blocks,
)
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
    PdserveNixlStats,
    model_shape,
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
        self.xfer_stats = PdserveNixlStats()
        self._pdserve_released_held: set[str] = set()
        """Held requests the engine service gave up on (:meth:`release_held`), reported free
        on the next step (main thread only)."""

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
        worker: Any = self
        for request_id in self._pdserve_released_held:
            if worker._reqs_to_send.pop(request_id, None) is not None or (
                request_id in worker._reqs_to_process
            ):
                worker._reqs_to_process.discard(request_id)
                results.finished_sending.add(request_id)
                worker.xfer_stats.record_release("consumer_gone")
                self._on_released(request_id)
        self._pdserve_released_held.clear()
        return results

    def release_held(self, request_id: str) -> bool:
        """Free the KV held for ``request_id`` on the next step, counted as ``consumer_gone``
        (:mod:`~services.engines.vllm.worker_extension`; main thread). Whether it is held."""
        worker: Any = self
        held = request_id in worker._reqs_to_send or request_id in worker._reqs_to_process
        if held and not self._in_flight(request_id):
            self._pdserve_released_held.add(request_id)
        return held

    def _in_flight(self, request_id: str) -> bool:
        """Whether a transfer of the request's blocks is under way (then it ends as usual)."""
        return False

    def _on_released(self, request_id: str) -> None:
        """A held request was reported free by :meth:`release_held`."""

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
        peer = VllmLayout(peer_role, own.mode, record.shape.pp_size, record.shape.tp_size)
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
    """vLLM's push worker with the hand-off's two missing answers (see
    :mod:`~services.engines.vllm.contracts`): a producer frees a request's blocks at once when
    the consumer registered nothing to receive, and a push it cannot carry out is reported to
    the consumer at once, which fails its receive instead of waiting for the WRITE.

    Producer side: :meth:`_do_start_push_kv` (writer thread) releases or pushes; a push that
    raised, or a WRITE that failed (:meth:`_handle_failed_transfer`), is queued, and
    :meth:`get_transfer_results` (main thread) tells the consumer and reports the request's
    blocks free once no WRITE of it is in flight. Consumer side: a failure notice arrives on
    vLLM's PUSH_REG channel (:meth:`_handle_push_reg_notif`) and fails the receive through
    vLLM's own queue."""

    def __init__(
        self, vllm_config: VllmConfig, engine_id: str, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, engine_id, kv_cache_config)
        self._pdserve_push_targets: dict[str, dict[str, Any]] = {}
        """Producer: the consumer registration each started push writes to (writer thread
        adds, main thread removes once the request is reported done)."""
        self._pdserve_failed_pushes: queue.SimpleQueue[tuple[str, str]] = queue.SimpleQueue()
        """Producer: (request, what failed) to tell the consumer and free (main thread)."""
        self._pdserve_releasing: set[str] = set()
        """Producer (main thread): failed pushes waiting for their last WRITE to finish."""

    # -- producer, writer thread ------------------------------------------------------------
    def _do_start_push_kv(
        self, request_id: str, local_block_ids: Any, registration_data: dict[str, Any]
    ) -> None:
        reason = registration_data.get(RELEASE_KEY)
        if reason is not None or no_blocks(registration_data.get("local_block_ids")):
            logger.info(
                "request %s: %s receives nothing (%s); freeing its blocks",
                request_id,
                registration_data.get("decode_engine_id"),
                reason or "no block registered",
            )
            self._mark_done_sending(request_id)
            return
        self._pdserve_push_targets[request_id] = registration_data
        try:
            super()._do_start_push_kv(request_id, local_block_ids, registration_data)
        except Exception as exc:
            logger.exception("request %s: push to %s failed", request_id,
                             registration_data.get("decode_engine_id"))  # fmt: skip
            self.xfer_stats.record_failed_transfer()
            self._pdserve_failed_pushes.put((request_id, f"{type(exc).__name__}: {exc}"))

    def _mark_done_sending(self, request_id: str) -> None:
        """Report the request's blocks free on the next step: vLLM reports a request whose
        list of WRITE handles is empty as done (and frees its blocks if it holds any)."""
        with self._sending_transfers_lock:
            self._sending_transfers.setdefault(request_id, [])
        self._push_writer_wake.set()

    # -- producer, main thread --------------------------------------------------------------
    def _handle_failed_transfer(self, req_id: str, handle: Any, *args: Any, **kwargs: Any) -> Any:
        """vLLM's failure bookkeeping; for a push of ours (a WRITE submission that raised on
        the writer thread, or a WRITE that completed in error on the main thread) the consumer
        is told and the blocks freed as well."""
        if req_id in self._pdserve_push_targets:
            self._pdserve_failed_pushes.put((req_id, "a WRITE failed"))
        return super()._handle_failed_transfer(req_id, handle, *args, **kwargs)

    def get_transfer_results(self) -> KVConnectorTransferResults:
        results = super().get_transfer_results()
        while True:
            try:
                request_id, what = self._pdserve_failed_pushes.get_nowait()
            except queue.Empty:
                break
            target = self._pdserve_push_targets.get(request_id)
            if target is not None and request_id not in self._pdserve_releasing:
                self._tell_consumer(request_id, target, what)
                self._pdserve_releasing.add(request_id)
        for request_id in list(self._pdserve_releasing):
            with self._sending_transfers_lock:
                in_flight = request_id in self._sending_transfers
                self._send_failures.discard(request_id)
            if in_flight:
                continue  # a sibling WRITE still reads the blocks: free once it finished
            self._pdserve_releasing.discard(request_id)
            if request_id in self._reqs_to_send or request_id in self._reqs_to_process:
                self._reqs_to_send.pop(request_id, None)
                self._reqs_to_process.discard(request_id)
                results.finished_sending.add(request_id)
                self._evict_finished_inbox.put(request_id)
                self.xfer_stats.record_release("push_failed")
        for request_id in results.finished_sending:
            self._pdserve_push_targets.pop(request_id, None)
        return results

    def _tell_consumer(self, request_id: str, target: dict[str, Any], what: str) -> None:
        """Send the consumer's ranks a failure notice for its request (best effort: a consumer
        that cannot be told waits for the router's idle bound, as before)."""
        engine_id = target["decode_engine_id"]
        notice = PUSH_REG_NOTIF_PREFIX + msgspec.msgpack.encode(
            {"request_id": target["request_id"], PUSH_FAILED_KEY: f"{self.engine_id}: {what}"}
        )
        with self._handshake_lock:
            agents = dict(self._remote_agents.get(engine_id) or {})
        logger.error(
            "request %s: the push to %s failed (%s); telling its %d rank(s) and freeing the blocks",
            request_id,
            engine_id,
            what,
            len(agents),
        )
        for rank, agent in agents.items():
            try:
                self.nixl_wrapper.send_notif(agent, notif_msg=notice)
            except Exception as exc:
                self._log_failure(
                    failure_type="push_failure_notice_failed",
                    req_id=request_id,
                    error=exc,
                    remote_rank=rank,
                )
                self.xfer_stats.record_failed_notification()

    def _in_flight(self, request_id: str) -> bool:
        with self._sending_transfers_lock:
            return request_id in self._sending_transfers

    def _on_released(self, request_id: str) -> None:
        self._evict_finished_inbox.put(request_id)  # the writer drops what it still holds
        self._push_writer_wake.set()

    # -- consumer, writer thread ------------------------------------------------------------
    def _handle_push_reg_notif(self, notif: bytes) -> None:
        try:
            payload = msgspec.msgpack.decode(notif[len(PUSH_REG_NOTIF_PREFIX) :])
        except Exception:
            payload = None  # vLLM's own handler logs it
        if isinstance(payload, dict) and PUSH_FAILED_KEY in payload:
            request_id = payload.get("request_id")
            if isinstance(request_id, str):
                logger.error(
                    "request %s: the producer could not push its KV (%s); failing the receive",
                    request_id,
                    payload[PUSH_FAILED_KEY],
                )
                self.xfer_stats.record_failed_transfer()
                self._failed_recv_reqs.put(request_id)
            return
        super()._handle_push_reg_notif(notif)


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
        self.planned_init(model_shape(self.vllm_config), get_pp_group().rank_in_group)
