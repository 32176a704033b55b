"""The building blocks of a Llama-family decoder layer, TP-sharded and reading a paged KV cache.

Numerics follow transformers' ``modeling_llama`` (RMSNorm in float32, rotate-half RoPE with
frequencies computed in float32), so logits match it to float32 rounding.
Parameters are created uninitialised: a model is always loaded from a checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 (the conventional torch alias)
from torch import nn

from services.engines.reference.batch import ForwardBatch
from services.engines.reference.config import ModelConfig
from services.engines.reference.sharding import ShardGeometry

AllReduce = Callable[[torch.Tensor], torch.Tensor]
"""Sums a tensor over the TP ranks of a stage and returns the sum (the same on every rank)."""


@dataclass(frozen=True)
class StepContext:
    """What every layer of a step shares: the batch and its RoPE angles ``[T, head_dim]``."""

    batch: ForwardBatch
    cos: torch.Tensor
    sin: torch.Tensor


def no_all_reduce(tensor: torch.Tensor) -> torch.Tensor:
    """The all-reduce of a TP group of one."""
    return tensor


class Linear(nn.Module):
    """``y = x W^T (+ b)`` over a (possibly column-sliced) weight. HF parameter names."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class Embedding(nn.Module):
    """A token-embedding table (replicated over TP). HF parameter name ``weight``."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype))

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class RowParallelLinear(nn.Module):
    """A linear layer whose input features are split over TP: partial products are summed by
    ``all_reduce``. The bias is added once, after the sum."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        all_reduce: AllReduce,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 as transformers does."""

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 RoPE frequencies, with the config's scaling applied."""
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type != "llama3":
        return inv_freq
    # Llama 3: long wavelengths are stretched by `factor`, short ones kept, the band between
    # interpolated (transformers' _compute_llama3_parameters).
    old_len = scaling.original_max_position_embeddings
    low_freq_wavelen = old_len / scaling.low_freq_factor
    high_freq_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rope_cos_sin(
    inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin`` of shape ``[T, head_dim]`` for the given positions."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape ``[T, heads, head_dim]`` (HF rotate-half convention)."""
    return x * cos[:, None, :] + _rotate_half(x) * sin[:, None, :]


class Attention(nn.Module):
    """Grouped-query self-attention over a paged KV cache, for this shard's heads.

    q/k/v are column-parallel (this rank's query and KV heads), o_proj is row-parallel.
    """

    def __init__(
        self,
        config: ModelConfig,
        geometry: ShardGeometry,
        dtype: torch.dtype,
        all_reduce: AllReduce,
    ) -> None:
        super().__init__()
        hidden, head_dim = config.hidden_size, config.head_dim
        self.num_heads = len(geometry.q_heads)
        self.num_kv_heads = len(geometry.kv_heads)
        self.head_dim = head_dim
        self.q_proj = Linear(hidden, self.num_heads * head_dim, config.qkv_bias, dtype)
        self.k_proj = Linear(hidden, self.num_kv_heads * head_dim, config.qkv_bias, dtype)
        self.v_proj = Linear(hidden, self.num_kv_heads * head_dim, config.qkv_bias, dtype)
        self.o_proj = RowParallelLinear(
            self.num_heads * head_dim, hidden, config.o_bias, dtype, all_reduce
        )

    def forward(
        self,
        x: torch.Tensor,
        step: StepContext,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        batch, cos, sin = step.batch, step.cos, step.sin
        tokens = x.shape[0]
        q = apply_rope(self.q_proj(x).view(tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(self.k_proj(x).view(tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = self.v_proj(x).view(tokens, self.num_kv_heads, self.head_dim)

        # Write first, then read: a chunk attends to its own new tokens through the cache.
        key_cache[batch.slot_blocks, :, batch.slot_offsets] = k.to(key_cache.dtype)
        value_cache[batch.slot_blocks, :, batch.slot_offsets] = v.to(value_cache.dtype)

        seqs = batch.num_sequences
        keys = self._gather(key_cache, batch.block_tables, x.dtype)
        values = self._gather(value_cache, batch.block_tables, x.dtype)
        max_query = int(batch.attn_mask.shape[2])
        queries = q.new_zeros(seqs, max_query, self.num_heads, self.head_dim)
        queries[batch.token_seq, batch.token_row] = q
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2),
            keys,
            values,
            attn_mask=batch.attn_mask,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        out = out.transpose(1, 2)[batch.token_seq, batch.token_row]
        result: torch.Tensor = self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim))
        return result

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``[S, kv_heads, blocks * block_size, head_dim]``: each sequence's blocks, in order."""
        seqs, blocks = tables.shape
        _, heads, block_size, head_dim = cache.shape
        gathered = cache[tables].permute(0, 2, 1, 3, 4)
        return gathered.reshape(seqs, heads, blocks * block_size, head_dim).to(dtype)


class MLP(nn.Module):
    """SwiGLU MLP: gate/up column-parallel over the MLP width, down row-parallel."""

    def __init__(
        self,
        config: ModelConfig,
        geometry: ShardGeometry,
        dtype: torch.dtype,
        all_reduce: AllReduce,
    ) -> None:
        super().__init__()
        hidden, width, bias = config.hidden_size, len(geometry.mlp_columns), config.mlp_bias
        self.gate_proj = Linear(hidden, width, bias, dtype)
        self.up_proj = Linear(hidden, width, bias, dtype)
        self.down_proj = RowParallelLinear(width, hidden, bias, dtype, all_reduce)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention + MLP, each with a residual connection."""

    def __init__(
        self,
        config: ModelConfig,
        geometry: ShardGeometry,
        dtype: torch.dtype,
        all_reduce: AllReduce,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, geometry, dtype, all_reduce)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, geometry, dtype, all_reduce)

    def forward(
        self,
        hidden: torch.Tensor,
        step: StepContext,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
    ) -> torch.Tensor:
        attn_out = self.self_attn(self.input_layernorm(hidden), step, key_cache, value_cache)
        hidden = hidden + attn_out
        out: torch.Tensor = hidden + self.mlp(self.post_attention_layernorm(hidden))
        return out
