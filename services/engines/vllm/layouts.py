"""Which PP x TP layouts pdserve's vLLM connector serves, checked at start-up.

See docs/vllm.md for the table:

- **Pull** (decode READs): every ``(PP, TP) -> (PP, TP)`` pair of the same dense model. The
  connector replaces vLLM 0.32.0's TP-ratio reads with pdserve's transfer plan
  (:mod:`~services.engines.vllm.transfer_plan`): each decode rank reads exactly its layers and
  KV heads from the prefill ranks that hold them, so decode PP, PP-sharded prefills, and TP in
  either direction (including TP above the number of KV heads) all work.
- **Push** (``NixlPushConnector``, prefill WRITEs, vLLM's own transfer): producer PP >= 1 into a
  PP=1 consumer, one TP size dividing the other (``TransferTopology.tp_ratio``); a PP > 1
  consumer needs pull mode.
- TP must fit the KV heads on each side (divide them, or be a multiple of them).
- Not covered by pdserve's connector: DCP/PCP > 1, MLA models, hybrid (HMA / Mamba) models: the
  control-plane record describes per-KV-head regions, which those layouts do not have.

Every check raises :class:`UnsupportedVllmLayout` naming the layout and what would work, before
any worker starts (local checks) or when a remote engine turns READY (pair checks), never at a
request. Pure code: no vLLM import.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

from services.engines.errors import ModelConfigError
from services.topology import Range


class UnsupportedVllmLayout(ModelConfigError):
    """A PP x TP layout (or pair of layouts) vLLM 0.32.0's NIXL transfer path cannot serve."""


class TransferMode(enum.StrEnum):
    """Who drives the NIXL transfer: decode READs (pull) or prefill WRITEs (push)."""

    PULL = "pull"
    PUSH = "push"


class KVRole(enum.StrEnum):
    """vLLM's ``kv_role`` for an engine."""

    PRODUCER = "kv_producer"
    CONSUMER = "kv_consumer"
    BOTH = "kv_both"


@dataclass(frozen=True)
class VllmLayout:
    """One vLLM engine's parallel layout and the model features that matter for transfer."""

    role: KVRole
    mode: TransferMode
    pp_size: int = 1
    tp_size: int = 1
    dcp_size: int = 1
    pcp_size: int = 1
    use_mla: bool = False
    hybrid_kv_cache: bool = False
    """Hybrid memory allocator groups (sliding window + full attention, Mamba...)."""

    def describe(self) -> str:
        return f"{self.role.value} PP={self.pp_size} TP={self.tp_size} ({self.mode.value})"


def check_local_layout(layout: VllmLayout) -> None:
    """Reject a layout this connector cannot serve whatever the peer; raise with what works."""
    where = layout.describe()
    if layout.pp_size < 1 or layout.tp_size < 1:
        raise UnsupportedVllmLayout(f"{where}: PP and TP must be >= 1")
    if layout.dcp_size != 1 or layout.pcp_size != 1:
        raise UnsupportedVllmLayout(
            f"{where}: decode/prefill context parallelism (DCP={layout.dcp_size}, "
            f"PCP={layout.pcp_size}) is not supported by pdserve's connector; use DCP=PCP=1"
        )
    if layout.use_mla:
        raise UnsupportedVllmLayout(
            f"{where}: MLA models keep one latent KV per layer, not per-KV-head regions; "
            "pdserve's connector supports dense multi-head (GQA/MHA) attention models"
        )
    if layout.hybrid_kv_cache:
        raise UnsupportedVllmLayout(
            f"{where}: hybrid KV caches (sliding window / Mamba groups) are not supported; "
            "use a full-attention model or --disable-hybrid-kv-cache-manager"
        )
    if (
        layout.pp_size > 1
        and layout.role is not KVRole.PRODUCER
        and layout.mode is not TransferMode.PULL
    ):
        raise UnsupportedVllmLayout(
            f"{where}: a PP > 1 decode needs pull mode (each decode stage reads its own "
            "layers); vLLM's push writers target a PP=1 decode"
        )


def check_pair(producer: VllmLayout, consumer: VllmLayout, *, num_kv_heads: int) -> None:
    """Reject a producer/consumer pair the connector cannot transfer between."""
    where = f"prefill {producer.describe()} -> decode {consumer.describe()}"
    if producer.mode is not consumer.mode:
        raise UnsupportedVllmLayout(
            f"{where}: both sides must use the same transfer mode (push and pull connectors "
            "are protocol-incompatible)"
        )
    if producer.mode is TransferMode.PUSH:
        if consumer.pp_size != 1:
            raise UnsupportedVllmLayout(f"{where}: push mode needs decode PP=1 (use pull mode)")
        big = max(producer.tp_size, consumer.tp_size)
        small = min(producer.tp_size, consumer.tp_size)
        if big % small:
            raise UnsupportedVllmLayout(
                f"{where}: in push mode one TP size must divide the other (vLLM's tp_ratio); "
                "pull mode serves any pair"
            )
    for side in (producer, consumer):
        if side.tp_size > num_kv_heads and side.tp_size % num_kv_heads:
            raise UnsupportedVllmLayout(
                f"{where}: TP={side.tp_size} above {num_kv_heads} KV heads must be a multiple"
            )
        if side.tp_size <= num_kv_heads and num_kv_heads % side.tp_size:
            raise UnsupportedVllmLayout(
                f"{where}: TP={side.tp_size} must divide the {num_kv_heads} KV heads"
            )


def vllm_layer_ranges(
    num_layers: int, pp_size: int, partition: Sequence[int] | None = None
) -> tuple[Range, ...]:
    """Each PP stage's layers exactly as vLLM cuts them (``vllm.distributed.utils
    .get_pp_indices``): an explicit ``VLLM_PP_LAYER_PARTITION``, else an even split whose extra
    layers go to the stages just before the last one (not the first stages: pdserve's reference
    engine differs there, which is why the vLLM records are built with this function)."""
    if pp_size < 1 or num_layers < pp_size:
        raise UnsupportedVllmLayout(f"cannot split {num_layers} layers over PP={pp_size}")
    if partition is not None:
        sizes = list(partition)
        if len(sizes) != pp_size or sum(sizes) != num_layers or min(sizes) < 1:
            raise UnsupportedVllmLayout(
                f"layer partition {sizes} does not split {num_layers} layers over PP={pp_size}"
            )
    else:
        sizes = [num_layers // pp_size] * pp_size
        for i in range(2, num_layers % pp_size + 2):
            sizes[-i] += 1
    ranges = []
    start = 0
    for size in sizes:
        ranges.append(Range(start, start + size))
        start += size
    return tuple(ranges)


def parse_layer_partition(value: str | None) -> tuple[int, ...] | None:
    """``VLLM_PP_LAYER_PARTITION`` (``"3,2,2"``) as sizes; ``None`` when unset or empty."""
    if not value:
        return None
    try:
        return tuple(int(part) for part in value.split(","))
    except ValueError as exc:
        raise UnsupportedVllmLayout(f"VLLM_PP_LAYER_PARTITION={value!r} is not a list") from exc
