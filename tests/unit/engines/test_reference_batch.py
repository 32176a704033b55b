"""``ForwardBatch`` indexing and ``PagedKVCache`` layout."""

from __future__ import annotations

import pytest
import torch

from services.engines.errors import BatchError
from services.engines.reference.batch import ForwardBatch, PagedKVCache, SequenceChunk
from services.engines.reference.config import ModelConfig
from services.engines.reference.sharding import ShardGeometry, ShardSpec
from services.topology import Range


def test_mixed_step_is_flattened_with_slots_and_a_causal_mask():
    chunks = [
        SequenceChunk((11,), num_cached=5, block_table=(7, 2, 9)),  # decode at position 5
        SequenceChunk((21, 22, 23), num_cached=0, block_table=(4, 8)),  # prefill
    ]

    batch = ForwardBatch.build(chunks, block_size=4)

    assert batch.input_ids.tolist() == [11, 21, 22, 23]
    assert batch.positions.tolist() == [5, 0, 1, 2]
    assert batch.slot_blocks.tolist() == [2, 4, 4, 4]
    assert batch.slot_offsets.tolist() == [1, 0, 1, 2]
    # Only blocks the step reads: 2 for the first sequence, 1 for the second (padded with 0).
    assert batch.block_tables.tolist() == [[7, 2], [4, 0]]
    assert batch.token_seq.tolist() == [0, 1, 1, 1]
    assert batch.token_row.tolist() == [0, 0, 1, 2]
    assert batch.last_token_indices.tolist() == [0, 3]
    assert batch.attn_mask.shape == (2, 1, 3, 8)
    assert batch.attn_mask[0, 0, 0].tolist() == [True] * 6 + [False] * 2
    assert batch.attn_mask[1, 0].tolist() == [
        [True, False, False, False, False, False, False, False],
        [True, True, False, False, False, False, False, False],
        [True, True, True, False, False, False, False, False],
    ]


@pytest.mark.parametrize(
    ("chunks", "message"),
    [
        ([], "at least one"),
        ([SequenceChunk((), 0, (0,))], "no new tokens"),
        ([SequenceChunk((1,), -1, (0,))], "num_cached"),
        ([SequenceChunk((1, 2), 3, (0,))], "do not hold 5 tokens"),
        ([SequenceChunk((1,), 0, (-1,))], "negative"),
    ],
)
def test_impossible_steps_are_rejected(chunks, message):
    with pytest.raises(BatchError, match=message):
        ForwardBatch.build(chunks, block_size=4)


def test_allocated_cache_is_hnd_with_each_blocks_head_slice_contiguous(tiny_llama):
    config = ModelConfig.from_directory(tiny_llama)
    geometry = ShardGeometry.resolve(config, ShardSpec(Range(2, 5), tp_rank=1, tp_size=2))

    cache = PagedKVCache.allocate(config, geometry, num_blocks=6, block_size=4)

    assert cache.num_layers == 3
    assert (cache.num_blocks, cache.num_kv_heads, cache.block_size, cache.head_dim) == (6, 1, 4, 64)
    for tensor in (*cache.keys, *cache.values):
        assert tensor.shape == (6, 1, 4, 64)
        assert tensor.is_contiguous()
        assert tensor[3].is_contiguous()


def test_cache_tensors_must_agree():
    k = torch.zeros(2, 1, 4, 16)
    with pytest.raises(BatchError):
        PagedKVCache([k], [torch.zeros(2, 1, 8, 16)])
    with pytest.raises(BatchError):
        PagedKVCache([k, k], [k])
