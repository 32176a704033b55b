"""The scheduler side of pdserve's vLLM connectors (EngineCore process): the PP x TP grid of
handshakes published to the control plane instead of a ZMQ listener
(:class:`SchedulerHandshake`), and vLLM's push and pull schedulers with the consumer's blocks
clipped to the producer's. Imports vLLM: loaded by :mod:`._connector_impl`."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlHandshakePayload,
    NixlPullConnectorScheduler,
    NixlPushConnectorScheduler,
)

from services.control_plane.errors import ControlPlaneError
from services.engines.vllm.contracts import (
    RELEASE_KEY,
    advance_grammar,
    clip_to_producer,
    holds_producer_blocks,
)
from services.engines.vllm.handshake import (
    ConnectorSettings,
    build_records,
    now_clocks,
)
from services.engines.vllm.layouts import (
    UnsupportedVllmLayout,
)
from services.engines.vllm.request_mapping import GRAMMAR_PREFIX_ARG

if TYPE_CHECKING:
    from vllm.config import VllmConfig
from services.engines.vllm._connector_common import (
    CONTROL_PLANE_HOST,
    ControlPlaneClient,
    PdserveNixlStats,
    model_shape,
    rank_transfer_info,
)

logger = logging.getLogger(__name__)


class SchedulerHandshake(ControlPlaneClient):
    """Scheduler-side mixin: publish the grid to the control plane instead of a ZMQ listener."""

    vllm_config: VllmConfig
    publications = 0

    def _pdserve_init(self, settings: ConnectorSettings) -> None:
        self.pdserve = settings
        self.pdserve_stats = PdserveNixlStats()
        """What this side counts (releases it decides), taken by the facade's
        ``get_kv_connector_stats``: vLLM's scheduler adds them to the workers' stats."""
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
            model_shape(self.vllm_config),
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


class ReceiveNothingOnFullHit:
    """Consumer-side mixin: a request whose producer blocks this engine's prefix cache already
    holds loads nothing (see :func:`~services.engines.vllm.contracts.holds_producer_blocks`).

    vLLM 0.32.0 counts the consumer's prompt (pdserve's decode request: the prompt plus the
    producer's first token) against its local hit and asks for the rest asynchronously even
    when that rest is only the first token's slot, which no producer block holds: push then
    registered no block while the producer pushed its last one (the writer asserted, the
    request hung), pull parked the request for an empty read. Answering "nothing to load"
    instead lets vLLM compute that slot locally at once; ``update_state_after_alloc`` tells the
    producer to free its blocks."""

    block_size: int
    pdserve_stats: PdserveNixlStats

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        # Before the request's first step, on producer and consumer alike (not a KV matter,
        # but the one scheduler hook vLLM calls then, with the grammar compiled).
        advance_grammar(request, GRAMMAR_PREFIX_ARG)
        count, load_async = super().get_num_new_matched_tokens(  # type: ignore[misc]
            request, num_computed_tokens
        )
        producer_blocks = _producer_blocks(request)
        if count > 0 and holds_producer_blocks(
            producer_blocks, num_computed_tokens, self.block_size
        ):
            logger.debug(
                "request %s: the prefix cache holds all %d computed tokens of the producer's "
                "blocks; nothing to load",
                request.request_id,
                num_computed_tokens,
            )
            return 0, False
        return count, load_async


class StampKVInPlace:
    """Consumer-side mixin: when vLLM's workers report a request's KV received (push: the
    producer's WRITE notification seen on every rank; pull: every rank's READ done), the wall
    clock then goes into pdserve's stats (:meth:`PdserveNixlStats.record_kv_in_place`); vLLM
    collects them in the same step, before the request can be scheduled, so the decode
    backend holds the stamp before the request's first token (:mod:`.transfer_metrics`)."""

    pdserve_stats: PdserveNixlStats

    def update_connector_output(self, connector_output: Any) -> None:
        at = time.time()
        for request_id in connector_output.finished_recving or ():
            self.pdserve_stats.record_kv_in_place(request_id, at)
        super().update_connector_output(connector_output)  # type: ignore[misc]


class PushScheduler(
    StampKVInPlace, ReceiveNothingOnFullHit, SchedulerHandshake, NixlPushConnectorScheduler
):
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's push registration without the consumer's blocks past the producer's
        (:func:`~services.engines.vllm.contracts.clip_to_producer`): otherwise a prompt that
        fills its last block exactly makes the producer's writer assert and drop the push
        ("nixl-push-writer error; continuing"), and the request hangs. With nothing to receive
        (a full prefix-cache hit), a release registration instead: the producer frees the
        request's blocks at once (vLLM's own push scheduler stages nothing then, and the
        producer held them until its lease ran out)."""
        producer_blocks = _producer_blocks(request)
        if producer_blocks and num_external_tokens <= 0:
            self.pdserve_stats.record_release("consumer_holds_prompt")
            self._stage_release(request, blocks, "consumer_holds_prompt")
            return
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        registration = self._push_pending_registrations.get(request.request_id)
        if registration is None or not producer_blocks:
            return
        registration["local_block_ids"] = clip_to_producer(
            registration["local_block_ids"], producer_blocks, _allocated(blocks)
        )

    def _stage_release(self, request: Any, blocks: Any, reason: str) -> None:
        """Send the producer a registration of no block (vLLM's PUSH_REG, shipped by the
        workers on the next step) that names ``reason``; nothing is awaited here."""
        params = request.kv_transfer_params
        self._push_pending_registrations[request.request_id] = {
            "request_id": request.request_id,
            "decode_engine_id": self.engine_id,
            "decode_host": self.side_channel_host,
            "decode_port": self.side_channel_port,
            "decode_tp_size": self.vllm_config.parallel_config.tensor_parallel_size,
            "local_block_ids": [[] for _group in blocks.blocks],
            "remote_engine_id": params["remote_engine_id"],
            "remote_host": params["remote_host"],
            "remote_port": params["remote_port"],
            "remote_tp_size": params["tp_size"],
            "remote_pp_size": params.get("pp_size", 1),
            RELEASE_KEY: reason,
        }
        params["do_remote_prefill"] = False  # one hand-off per request, as vLLM marks it
        logger.info(
            "request %s: nothing to receive from %s (%s); asking it to free its blocks",
            request.request_id,
            params["remote_engine_id"],
            reason,
        )


class PullScheduler(
    StampKVInPlace, ReceiveNothingOnFullHit, SchedulerHandshake, NixlPullConnectorScheduler
):
    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        """vLLM's pending read without the consumer's blocks past the producer's (see
        :class:`PushScheduler`; here ``_apply_prefix_caching`` asserts and the worker dies).
        A full prefix-cache hit is vLLM's empty read: the worker notifies every producer rank
        it owes, which frees the blocks at once."""
        producer_blocks = _producer_blocks(request)
        if producer_blocks and num_external_tokens <= 0:
            self.pdserve_stats.record_release("consumer_holds_prompt")
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        pending = self._reqs_need_recv.get(request.request_id)
        if pending is None or not producer_blocks:
            return
        pending_request, local_blocks, *rest = pending
        clipped = clip_to_producer(local_blocks, producer_blocks, _allocated(blocks))
        self._reqs_need_recv[request.request_id] = (pending_request, clipped, *rest)
