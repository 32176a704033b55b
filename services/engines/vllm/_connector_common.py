"""What both sides of pdserve's vLLM connector share: the local layout and model geometry read
from vLLM's config, a rank's NIXL payload in the control plane's terms, and the lazily opened
control-plane bridge (:class:`ControlPlaneClient`). Imports vLLM: loaded by
:mod:`._connector_impl`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import msgspec
from vllm import envs
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import (
    NixlAgentMetadata,
    NixlHandshakePayload,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.stats import NixlKVConnectorStats
from vllm.v1.kv_cache_interface import FullAttentionSpec

from services.engines.vllm.contracts import RELEASE_REASONS
from services.engines.vllm.handshake import (
    ConnectorSettings,
    ControlPlaneBridge,
    RankTransferInfo,
)
from services.engines.vllm.layouts import (
    KVRole,
    TransferMode,
    UnsupportedVllmLayout,
    VllmLayout,
    parse_layer_partition,
)
from services.engines.vllm.transfer_metrics import KV_IN_PLACE_KEY, release_stat_key
from services.topology import ModelShape

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

logger = logging.getLogger(__name__)


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


def model_shape(vllm_config: VllmConfig) -> ModelShape:
    """Layers, KV heads, head size, KV dtype and the PP x TP cut; the layer partition is
    ``VLLM_PP_LAYER_PARTITION``'s (vLLM's stages are :func:`vllm_layer_ranges` of it, not
    :meth:`ModelShape.layout`'s even split)."""
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache_dtype = vllm_config.cache_config.cache_dtype
    dtype = str(model.dtype if cache_dtype == "auto" else cache_dtype).removeprefix("torch.")
    return ModelShape(
        num_layers=model.get_total_num_hidden_layers(),
        num_kv_heads=model.get_total_num_kv_heads(),
        head_size=model.get_head_size(),
        dtype=dtype,
        pp_size=parallel.pipeline_parallel_size,
        tp_size=parallel.tensor_parallel_size,
        layer_partition=parse_layer_partition(envs.VLLM_PP_LAYER_PARTITION),
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


class ControlPlaneClient:
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


_RELEASE_KEYS = tuple(release_stat_key(reason) for reason in RELEASE_REASONS)
_PDSERVE_KEYS = (*_RELEASE_KEYS, KV_IN_PLACE_KEY)


class PdserveNixlStats(NixlKVConnectorStats):
    """vLLM's NIXL transfer stats plus pdserve's releases (a request's producer blocks freed at
    once because no consumer will read them), one list per reason like vLLM's failure counts,
    and a consumer's KV-in-place stamps (:data:`KV_IN_PLACE_KEY`), so they travel the same way:
    workers and the scheduler -> EngineCore's aggregate -> the engine service's stat loggers
    (:mod:`~services.engines.vllm.transfer_metrics`)."""

    def reset(self) -> None:
        super().reset()
        for key in _PDSERVE_KEYS:
            self.data[key] = []

    def record_release(self, reason: str) -> None:
        self.data[release_stat_key(reason)].append(1)

    def record_kv_in_place(self, request_id: str, at: float) -> None:
        self.data[KV_IN_PLACE_KEY].append([request_id, at])

    def is_empty(self) -> bool:
        return super().is_empty() and not any(self.data.get(key) for key in _PDSERVE_KEYS)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        # Tolerates either side lacking pdserve's keys (vLLM's own class, an older peer).
        if not other.is_empty():
            for key, values in other.data.items():
                self.data.setdefault(key, []).extend(values)
        return self
