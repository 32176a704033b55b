"""One forward step's batch, and the paged KV cache it reads and writes.

A step is a list of :class:`SequenceChunk`: each sequence contributes its new tokens (a prefill
chunk, or one decode token) on top of ``num_cached`` tokens whose K/V are already in the cache.
Prefill chunks and decode tokens may be mixed in one step. :meth:`ForwardBatch.build` flattens
them (vLLM-style, ``T`` = total new tokens) and precomputes, once per step, every index the
layers need: the cache slot of each new token, the block tables, and the causal mask. Every PP
stage and TP rank builds the same batch from the same chunks.

KV layout (HND): per local layer a K and a V tensor of shape
``[num_blocks, num_kv_heads, block_size, head_dim]``. One block of one layer for a slice of
heads is one contiguous range, which is what the KV data plane registers and moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from services.engines.errors import BatchError
from services.engines.reference.config import ModelConfig
from services.engines.reference.sharding import ShardGeometry

BlockTable = tuple[int, ...]


@dataclass(frozen=True)
class SequenceChunk:
    """One sequence's share of a step.

    ``token_ids`` are the new tokens, at positions ``num_cached .. num_cached + len - 1``.
    ``block_table`` lists the sequence's KV blocks in order; it must cover every position up to
    the last new token (it may hold more, pre-allocated blocks).
    """

    token_ids: tuple[int, ...]
    num_cached: int
    block_table: BlockTable

    @property
    def context_len(self) -> int:
        """Tokens of this sequence in the cache once the step has run."""
        return self.num_cached + len(self.token_ids)


@dataclass(frozen=True)
class ForwardBatch:
    """The flattened, index-ready form of a step (see the module docstring).

    Tensors, with ``S`` sequences, ``T`` new tokens, ``Q`` the longest chunk, ``K`` the longest
    context rounded up to whole blocks:

    - ``input_ids``, ``positions``: ``[T]``;
    - ``slot_blocks``, ``slot_offsets``: ``[T]``, where each new token's K/V is written;
    - ``block_tables``: ``[S, K // block_size]`` (short tables padded with block 0, which the
      mask hides);
    - ``token_seq``, ``token_row``: ``[T]``, a new token's sequence and row in the padded
      ``[S, Q]`` query layout;
    - ``attn_mask``: ``[S, 1, Q, K]`` bool, true where a query may attend to a key;
    - ``last_token_indices``: ``[S]``, the index in ``T`` of each sequence's last new token.
    """

    chunks: tuple[SequenceChunk, ...]
    block_size: int
    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    block_tables: torch.Tensor
    token_seq: torch.Tensor
    token_row: torch.Tensor
    attn_mask: torch.Tensor
    last_token_indices: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """``T``: new tokens in the step."""
        return int(self.input_ids.shape[0])

    @property
    def num_sequences(self) -> int:
        """``S``: sequences in the step."""
        return len(self.chunks)

    @classmethod
    def build(cls, chunks: Sequence[SequenceChunk], block_size: int) -> ForwardBatch:
        """Index a step. Raises :class:`BatchError` for an empty step or chunk, a negative
        ``num_cached``, or a block table that does not cover the chunk."""
        if block_size < 1:
            raise BatchError(f"block_size must be positive, got {block_size}")
        if not chunks:
            raise BatchError("a step needs at least one sequence")
        for index, chunk in enumerate(chunks):
            if not chunk.token_ids:
                raise BatchError(f"sequence {index} has no new tokens")
            if chunk.num_cached < 0:
                raise BatchError(f"sequence {index} has num_cached {chunk.num_cached} < 0")
            if len(chunk.block_table) * block_size < chunk.context_len:
                raise BatchError(
                    f"sequence {index}: {len(chunk.block_table)} blocks of {block_size} do not "
                    f"hold {chunk.context_len} tokens"
                )
            if min(chunk.block_table) < 0:
                raise BatchError(f"sequence {index} has a negative block id")

        lengths = [len(chunk.token_ids) for chunk in chunks]
        max_query = max(lengths)
        # Only the blocks the step reads; tables may carry pre-allocated ones beyond them.
        used_blocks = [-(-chunk.context_len // block_size) for chunk in chunks]
        max_blocks = max(used_blocks)

        input_ids = torch.tensor([t for chunk in chunks for t in chunk.token_ids], dtype=torch.long)
        positions = torch.cat(
            [torch.arange(c.num_cached, c.context_len, dtype=torch.long) for c in chunks]
        )
        tables = torch.zeros(len(chunks), max_blocks, dtype=torch.long)
        for index, (chunk, used) in enumerate(zip(chunks, used_blocks, strict=True)):
            tables[index, :used] = torch.tensor(chunk.block_table[:used], dtype=torch.long)
        token_seq = torch.repeat_interleave(
            torch.arange(len(chunks), dtype=torch.long), torch.tensor(lengths)
        )
        starts = torch.tensor([0, *lengths[:-1]], dtype=torch.long).cumsum(0)
        token_row = torch.arange(len(input_ids), dtype=torch.long) - starts[token_seq]
        slot_blocks = tables[token_seq, positions // block_size]

        # Padded query rows get position 0 so they see key 0 and never a fully masked row
        # (which would make softmax NaN); their outputs are dropped.
        query_positions = torch.zeros(len(chunks), max_query, dtype=torch.long)
        query_positions[token_seq, token_row] = positions
        key_positions = torch.arange(max_blocks * block_size, dtype=torch.long)
        # Causal on absolute positions also hides keys past a sequence's own context, including
        # the padded part of its block table.
        attn_mask = key_positions[None, None, None, :] <= query_positions[:, None, :, None]
        return cls(
            chunks=tuple(chunks),
            block_size=block_size,
            input_ids=input_ids,
            positions=positions,
            slot_blocks=slot_blocks,
            slot_offsets=positions % block_size,
            block_tables=tables,
            token_seq=token_seq,
            token_row=token_row,
            attn_mask=attn_mask,
            last_token_indices=torch.tensor(lengths, dtype=torch.long).cumsum(0) - 1,
        )


class PagedKVCache:
    """The paged K/V of one shard: for each of its layers, a K and a V tensor.

    Each tensor is ``[num_blocks, num_kv_heads, block_size, head_dim]`` with the shard's local
    KV heads. The cache does not own block allocation: the scheduler (or the KV data plane's
    block pool) hands out block ids and passes them in :class:`SequenceChunk` block tables.
    """

    def __init__(self, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        if not keys or len(keys) != len(values):
            raise BatchError("a KV cache needs one K and one V tensor per layer")
        shape = keys[0].shape
        for tensor in (*keys, *values):
            if tensor.dim() != 4 or tensor.shape != shape or tensor.dtype != keys[0].dtype:
                raise BatchError(
                    f"every KV tensor must be [num_blocks, kv_heads, block_size, head_dim] like "
                    f"the first ({tuple(shape)}, {keys[0].dtype}); got {tuple(tensor.shape)}, "
                    f"{tensor.dtype}"
                )
        self.keys = tuple(keys)
        self.values = tuple(values)

    @classmethod
    def allocate(
        cls,
        config: ModelConfig,
        geometry: ShardGeometry,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
    ) -> PagedKVCache:
        """Zeroed cache for a shard, as views of one buffer ``[layers, 2, blocks, ...]``."""
        buffer = torch.zeros(
            geometry.num_local_layers,
            2,
            num_blocks,
            len(geometry.kv_heads),
            block_size,
            config.head_dim,
            dtype=dtype,
        )
        return cls(list(buffer[:, 0]), list(buffer[:, 1]))

    @property
    def num_layers(self) -> int:
        """Layers held (the shard's local layers, in order)."""
        return len(self.keys)

    @property
    def num_blocks(self) -> int:
        """Blocks per layer."""
        return int(self.keys[0].shape[0])

    @property
    def num_kv_heads(self) -> int:
        """Local KV heads."""
        return int(self.keys[0].shape[1])

    @property
    def block_size(self) -> int:
        """Token slots per block."""
        return int(self.keys[0].shape[2])

    @property
    def head_dim(self) -> int:
        """Elements per head per token."""
        return int(self.keys[0].shape[3])
