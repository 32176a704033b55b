"""One PP x TP shard of a Llama-family decoder, stepping a paged KV cache.

A continuous-batching engine drives it per step, on every worker::

    batch = ForwardBatch.build(chunks, block_size)      # same chunks on every rank
    hidden = shard(batch, kv_cache)                     # first stage: embeds batch.input_ids
    hidden = shard(batch, kv_cache, hidden_states=h)    # later stages: h from the previous stage
    logits = shard.compute_logits(hidden, batch.last_token_indices)   # last stage only

TP ranks of a stage run in lockstep: each row-parallel projection calls the injected
``all_reduce`` once per layer for attention and once for the MLP, so every rank of a stage must
run the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from services.engines.errors import BatchError, ShardingError
from services.engines.reference.batch import ForwardBatch, PagedKVCache
from services.engines.reference.config import ModelConfig
from services.engines.reference.layers import (
    AllReduce,
    DecoderLayer,
    Embedding,
    Linear,
    RMSNorm,
    StepContext,
    no_all_reduce,
    rope_cos_sin,
    rope_inverse_frequencies,
)
from services.engines.reference.sharding import ShardGeometry, ShardSpec
from services.topology import Range


@dataclass(frozen=True)
class WeightSource:
    """Where a shard parameter comes from in an HF checkpoint.

    The tensor ``name`` has shape ``full_shape``; the shard takes ``[part.start, part.stop)``
    along ``dim``, or all of it when ``dim`` is ``None``.
    """

    name: str
    full_shape: tuple[int, ...]
    dim: int | None = None
    part: Range | None = None


class LlamaShard(nn.Module):
    """The layers ``spec.layers`` of a Llama-family model, at TP rank ``spec.tp_rank``.

    The first stage owns the embeddings, the last the final norm and ``lm_head``; both are
    replicated over TP. Parameters start uninitialised: fill them with
    ``services.engines.reference.loader.load_weights`` (the names and slices each needs are
    :meth:`weight_sources`). Parameters never require grad; the KV cache is written in place.

    Raises :class:`ShardingError` when the model cannot be cut this way, or when TP > 1 and no
    ``all_reduce`` is given.
    """

    inv_freq: torch.Tensor
    """RoPE inverse frequencies (a non-persistent buffer, computed from the config)."""

    def __init__(
        self,
        config: ModelConfig,
        spec: ShardSpec | None = None,
        *,
        all_reduce: AllReduce | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        super().__init__()
        geometry = ShardGeometry.resolve(config, spec or ShardSpec.whole(config))
        if all_reduce is None:
            if geometry.tp_size > 1:
                raise ShardingError(f"TP={geometry.tp_size} needs an all_reduce")
            all_reduce = no_all_reduce
        self.config = config
        self.geometry = geometry
        self.dtype = dtype
        hidden = config.hidden_size
        self.embed_tokens: Embedding | None = None
        if geometry.is_first_stage:
            self.embed_tokens = Embedding(config.vocab_size, hidden, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(config, geometry, dtype, all_reduce) for _ in geometry.layers
        )
        self.norm: RMSNorm | None = None
        self.lm_head: Linear | None = None
        if geometry.is_last_stage:
            self.norm = RMSNorm(hidden, config.rms_norm_eps, dtype)
            self.lm_head = Linear(hidden, config.vocab_size, False, dtype)
            if config.tie_word_embeddings and self.embed_tokens is not None:
                self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.requires_grad_(False)

    def forward(
        self,
        batch: ForwardBatch,
        kv_cache: PagedKVCache,
        hidden_states: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run this shard's layers for one step.

        The first stage embeds ``batch.input_ids`` (``hidden_states`` must be ``None``); any
        other stage takes ``hidden_states`` ``[T, hidden]`` from the previous stage. Every layer
        writes the new tokens' K/V into ``kv_cache`` at their block-table slots, then attends
        causally over each sequence's cached prefix and new tokens.

        Returns ``[T, hidden]``: the input of the next stage or, on the last stage, the final
        normed states for :meth:`compute_logits`. Raises :class:`BatchError`, with the cache
        untouched, when the inputs do not fit this stage or the cache (wrong input for the
        stage, a block id or token id out of range, a position at or beyond
        ``max_position_embeddings``).
        """
        self._check_step(batch, kv_cache, hidden_states)
        if self.embed_tokens is not None:
            hidden: torch.Tensor = self.embed_tokens(batch.input_ids)
        else:
            assert hidden_states is not None  # _check_step
            hidden = hidden_states.to(self.dtype)
        cos, sin = rope_cos_sin(self.inv_freq, batch.positions, self.dtype)
        step = StepContext(batch, cos, sin)
        for index, layer in enumerate(self.layers):
            hidden = layer(hidden, step, kv_cache.keys[index], kv_cache.values[index])
        if self.norm is not None:
            hidden = self.norm(hidden)
        return hidden

    def compute_logits(
        self, hidden: torch.Tensor, indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``[N, vocab]`` logits of the rows ``indices`` of the last stage's output (all rows
        when ``None``; engines pass ``batch.last_token_indices``)."""
        if self.lm_head is None:
            raise ShardingError("only the last PP stage computes logits")
        rows = hidden if indices is None else hidden[indices]
        logits: torch.Tensor = self.lm_head(rows)
        return logits

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, dtype: torch.dtype | None = None
    ) -> PagedKVCache:
        """A zeroed cache shaped for this shard (the model's dtype unless ``dtype`` is given)."""
        return PagedKVCache.allocate(
            self.config, self.geometry, num_blocks, block_size, dtype or self.dtype
        )

    def weight_sources(self) -> dict[str, WeightSource]:
        """For every parameter (by ``named_parameters`` name), its checkpoint tensor and slice."""
        config, geo = self.config, self.geometry
        hidden, head_dim = config.hidden_size, config.head_dim
        q_rows = Range(geo.q_heads.start * head_dim, geo.q_heads.stop * head_dim)
        kv_rows = Range(geo.kv_heads.start * head_dim, geo.kv_heads.stop * head_dim)
        q_width = config.num_attention_heads * head_dim
        kv_width = config.num_key_value_heads * head_dim
        width = config.intermediate_size
        # (local suffix, full shape, split dim, part) for each per-layer tensor.
        per_layer: list[tuple[str, tuple[int, ...], int | None, Range | None]] = [
            ("input_layernorm.weight", (hidden,), None, None),
            ("post_attention_layernorm.weight", (hidden,), None, None),
            ("self_attn.q_proj.weight", (q_width, hidden), 0, q_rows),
            ("self_attn.k_proj.weight", (kv_width, hidden), 0, kv_rows),
            ("self_attn.v_proj.weight", (kv_width, hidden), 0, kv_rows),
            ("self_attn.o_proj.weight", (hidden, q_width), 1, q_rows),
            ("mlp.gate_proj.weight", (width, hidden), 0, geo.mlp_columns),
            ("mlp.up_proj.weight", (width, hidden), 0, geo.mlp_columns),
            ("mlp.down_proj.weight", (hidden, width), 1, geo.mlp_columns),
        ]
        if config.qkv_bias:
            per_layer += [
                ("self_attn.q_proj.bias", (q_width,), 0, q_rows),
                ("self_attn.k_proj.bias", (kv_width,), 0, kv_rows),
                ("self_attn.v_proj.bias", (kv_width,), 0, kv_rows),
            ]
        if config.o_bias:
            per_layer.append(("self_attn.o_proj.bias", (hidden,), None, None))
        if config.mlp_bias:
            per_layer += [
                ("mlp.gate_proj.bias", (width,), 0, geo.mlp_columns),
                ("mlp.up_proj.bias", (width,), 0, geo.mlp_columns),
                ("mlp.down_proj.bias", (hidden,), None, None),
            ]
        sources: dict[str, WeightSource] = {}
        for local, global_index in enumerate(geo.layers):
            for suffix, shape, dim, part in per_layer:
                sources[f"layers.{local}.{suffix}"] = WeightSource(
                    f"model.layers.{global_index}.{suffix}", shape, dim, part
                )
        embedding_shape = (config.vocab_size, hidden)
        if self.embed_tokens is not None:
            sources["embed_tokens.weight"] = WeightSource(
                "model.embed_tokens.weight", embedding_shape
            )
        if self.norm is not None:
            sources["norm.weight"] = WeightSource("model.norm.weight", (hidden,))
        head_name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        names = {name for name, _ in self.named_parameters()}
        if "lm_head.weight" in names:  # absent when tied to this shard's own embeddings
            sources["lm_head.weight"] = WeightSource(head_name, embedding_shape)
        return sources

    def _check_step(
        self, batch: ForwardBatch, kv_cache: PagedKVCache, hidden_states: torch.Tensor | None
    ) -> None:
        geo = self.geometry
        if geo.is_first_stage and hidden_states is not None:
            raise BatchError("the first PP stage embeds input_ids; do not pass hidden_states")
        if not geo.is_first_stage:
            expected = (batch.num_tokens, self.config.hidden_size)
            if hidden_states is None or tuple(hidden_states.shape) != expected:
                got = None if hidden_states is None else tuple(hidden_states.shape)
                raise BatchError(
                    f"stage starting at layer {geo.layers.start} needs hidden "
                    f"states of shape {expected}, got {got}"
                )
        expected_cache = (
            len(geo.layers),
            len(geo.kv_heads),
            batch.block_size,
            self.config.head_dim,
        )
        got_cache = (
            kv_cache.num_layers,
            kv_cache.num_kv_heads,
            kv_cache.block_size,
            kv_cache.head_dim,
        )
        if got_cache != expected_cache:
            raise BatchError(
                f"KV cache (layers, kv_heads, block_size, head_dim) is {got_cache}, this shard "
                f"and batch need {expected_cache}"
            )
        if int(batch.block_tables.max()) >= kv_cache.num_blocks:
            raise BatchError(
                f"block id {int(batch.block_tables.max())} outside the cache's "
                f"{kv_cache.num_blocks} blocks"
            )
        if geo.is_first_stage and not (
            int(batch.input_ids.min()) >= 0 and int(batch.input_ids.max()) < self.config.vocab_size
        ):
            raise BatchError(f"a token id is outside the vocabulary of {self.config.vocab_size}")
        if int(batch.positions.max()) >= self.config.max_position_embeddings:
            raise BatchError(
                f"position {int(batch.positions.max())} beyond max_position_embeddings "
                f"{self.config.max_position_embeddings}"
            )
