"""Which part of the model one ``(pp_rank, tp_rank)`` worker holds.

The cut follows vLLM (and ``services.topology``): PP stages own contiguous global layer ranges;
TP is Megatron-style within a stage. q/k/v and gate/up are column-parallel (split by heads and by
MLP width), o_proj and down_proj are row-parallel and followed by an all-reduce. The KV heads of a
TP rank are ``services.topology.kv_head_range``: when TP exceeds the number of KV heads, each rank
holds one KV head, replicated over ``tp_size // num_kv_heads`` ranks. Query heads always divide
evenly, so a rank's query heads all read from the KV heads it holds. Embeddings and ``lm_head``
are replicated over TP (the first stage holds the embeddings, the last the final norm and head).
"""

from __future__ import annotations

from dataclasses import dataclass

from services.engines.errors import ShardingError
from services.engines.reference.config import ModelConfig
from services.topology import EngineLayout, Range, kv_head_range
from services.topology.errors import LayoutError


@dataclass(frozen=True)
class ShardSpec:
    """The shard a worker asks for: a global layer range and a TP rank of a TP size."""

    layers: Range
    tp_rank: int = 0
    tp_size: int = 1

    @classmethod
    def whole(cls, config: ModelConfig) -> ShardSpec:
        """The unsharded model (PP = TP = 1)."""
        return cls(Range(0, config.num_hidden_layers))

    @classmethod
    def from_layout(cls, layout: EngineLayout, pp_rank: int, tp_rank: int) -> ShardSpec:
        """The shard of ``(pp_rank, tp_rank)`` in an engine layout."""
        try:
            shard = layout.shards[(pp_rank, tp_rank)]
        except KeyError as exc:
            raise ShardingError(f"no rank ({pp_rank}, {tp_rank}) in the layout") from exc
        return cls(shard.layers, tp_rank, layout.tp_size)


@dataclass(frozen=True)
class ShardGeometry:
    """A :class:`ShardSpec` resolved against a config: every range this shard owns.

    Ranges are global (indices into the unsharded model's heads, layers, MLP width).
    """

    layers: Range
    tp_rank: int
    tp_size: int
    q_heads: Range
    kv_heads: Range
    mlp_columns: Range
    is_first_stage: bool
    is_last_stage: bool

    @classmethod
    def resolve(cls, config: ModelConfig, spec: ShardSpec) -> ShardGeometry:
        """Validate ``spec`` against ``config``; raises :class:`ShardingError`."""
        layers, tp_rank, tp_size = spec.layers, spec.tp_rank, spec.tp_size
        if not layers or layers.stop > config.num_hidden_layers:
            raise ShardingError(
                f"layer range {layers} is empty or outside the model's "
                f"{config.num_hidden_layers} layers"
            )
        num_heads, num_kv = config.num_attention_heads, config.num_key_value_heads
        try:
            kv_heads = kv_head_range(num_kv, tp_size, tp_rank)
        except LayoutError as exc:
            raise ShardingError(f"cannot split {num_kv} KV heads over TP={tp_size}: {exc}") from exc
        if num_heads % tp_size:
            raise ShardingError(f"{num_heads} attention heads do not divide over TP={tp_size}")
        if config.intermediate_size % tp_size:
            raise ShardingError(
                f"intermediate_size {config.intermediate_size} does not divide over TP={tp_size}"
            )
        q_per_rank = num_heads // tp_size
        mlp_per_rank = config.intermediate_size // tp_size
        return cls(
            layers=layers,
            tp_rank=tp_rank,
            tp_size=tp_size,
            q_heads=Range(tp_rank * q_per_rank, (tp_rank + 1) * q_per_rank),
            kv_heads=kv_heads,
            mlp_columns=Range(tp_rank * mlp_per_rank, (tp_rank + 1) * mlp_per_rank),
            is_first_stage=layers.start == 0,
            is_last_stage=layers.stop == config.num_hidden_layers,
        )

    @property
    def num_local_layers(self) -> int:
        """Layers this shard runs (and KV-cache tensor pairs it owns)."""
        return len(self.layers)
