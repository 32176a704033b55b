"""PP x TP shards of the reference model, run together in one process (``LocalShardGroup``:
stages in sequence, TP ranks on threads summing their partial outputs), against the unsharded
model. float32; logits within ``atol = rtol = 1e-4``, greedy tokens identical."""

from __future__ import annotations

import pytest
import torch

from services.engines.errors import BatchError, ShardingError
from services.engines.reference.batch import ForwardBatch, SequenceChunk
from services.engines.reference.config import ModelConfig
from services.engines.reference.loader import load_model
from services.engines.reference.model import LlamaShard
from services.engines.reference.sharding import ShardGeometry, ShardSpec
from services.topology import Range

ATOL = RTOL = 1e-4
PROMPT = [0, *range(200, 223)]
DECODE_STEPS = 5

LAYOUTS = {
    "pp2": (2, 1, None),
    "pp3-uneven": (3, 1, None),  # 3/2/2 layers
    "pp3-partition-1-5-1": (3, 1, [1, 5, 1]),
    "tp2": (1, 2, None),
    "tp4-replicated-kv": (1, 4, None),  # TP > 2 KV heads: each KV head on two ranks
    "pp2xtp2": (2, 2, None),
    "pp3xtp4": (3, 4, None),
}


@pytest.mark.parametrize("variant", ["llama", "qwen2"])
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_sharded_layout_matches_unsharded(
    name, variant, tiny_llama, tiny_qwen2, make_group, greedy
):
    directory = tiny_llama if variant == "llama" else tiny_qwen2
    pp, tp, partition = LAYOUTS[name]
    expected_tokens, expected_logits = greedy(make_group(directory), PROMPT, DECODE_STEPS)

    tokens, logits = greedy(make_group(directory, pp, tp, partition), PROMPT, DECODE_STEPS)

    assert tokens == expected_tokens
    for got, want in zip(logits, expected_logits, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_tp_ranks_split_query_heads_and_replicate_kv_heads_beyond_their_count(tiny_llama):
    config = ModelConfig.from_directory(tiny_llama)
    geometries = [
        ShardGeometry.resolve(config, ShardSpec(Range(0, 7), rank, 4)) for rank in range(4)
    ]

    assert [g.q_heads for g in geometries] == [Range(i, i + 1) for i in range(4)]
    assert [g.kv_heads for g in geometries] == [Range(0, 1), Range(0, 1), Range(1, 2), Range(1, 2)]
    assert [g.mlp_columns for g in geometries] == [Range(32 * i, 32 * (i + 1)) for i in range(4)]
    # GQA: query head h reads KV head h // 2, which its rank holds.
    for g in geometries:
        assert g.q_heads.start // config.num_queries_per_kv in g.kv_heads


def test_shard_loads_only_its_rows_and_columns(tiny_llama):
    whole = load_model(tiny_llama)
    rank1 = load_model(
        tiny_llama, ShardSpec(Range(4, 7), tp_rank=1, tp_size=2), all_reduce=lambda t: t
    )

    assert rank1.embed_tokens is None and rank1.lm_head is not None
    assert len(rank1.layers) == 3
    full = dict(whole.named_parameters())
    part = dict(rank1.named_parameters())
    # Global layer 5 is local layer 1 of the [4, 7) stage; rank 1 of 2 holds the second half
    # of the query heads (rows 128:256 at head_dim 64), KV head 1 (rows 64:128) and MLP
    # columns 64:128.
    for local_name, rows, cols in [
        ("self_attn.q_proj.weight", slice(128, 256), slice(None)),
        ("self_attn.k_proj.weight", slice(64, 128), slice(None)),
        ("self_attn.v_proj.weight", slice(64, 128), slice(None)),
        ("self_attn.o_proj.weight", slice(None), slice(128, 256)),
        ("mlp.gate_proj.weight", slice(64, 128), slice(None)),
        ("mlp.down_proj.weight", slice(None), slice(64, 128)),
        ("input_layernorm.weight", slice(None), None),
    ]:
        expected = full[f"layers.5.{local_name}"][rows]
        if cols is not None:
            expected = expected[:, cols]
        torch.testing.assert_close(part[f"layers.1.{local_name}"], expected)
    torch.testing.assert_close(part["norm.weight"], full["norm.weight"])


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (ShardSpec(Range(0, 7), 0, 3), "KV heads"),
        (ShardSpec(Range(0, 7), 0, 8), "attention heads"),
        (ShardSpec(Range(5, 8)), "outside"),
        (ShardSpec(Range(3, 3)), "empty"),
    ],
)
def test_impossible_shards_are_rejected(tiny_llama, spec, message):
    config = ModelConfig.from_directory(tiny_llama)
    with pytest.raises(ShardingError, match=message):
        LlamaShard(config, spec, all_reduce=lambda t: t)


def test_tp_shard_without_all_reduce_is_rejected(tiny_llama):
    config = ModelConfig.from_directory(tiny_llama)
    with pytest.raises(ShardingError, match="all_reduce"):
        LlamaShard(config, ShardSpec(Range(0, 7), 0, 2))


def test_stage_inputs_are_checked_before_the_cache_is_touched(tiny_llama):
    first = load_model(tiny_llama, ShardSpec(Range(0, 3)))
    middle = load_model(tiny_llama, ShardSpec(Range(3, 5)))
    batch = ForwardBatch.build([SequenceChunk((1, 2, 3), 0, (0,))], block_size=4)
    first_cache, middle_cache = first.allocate_kv_cache(4, 4), middle.allocate_kv_cache(4, 4)

    with pytest.raises(BatchError, match="first PP stage"):
        first(batch, first_cache, torch.zeros(3, 64))
    with pytest.raises(BatchError, match="hidden"):
        middle(batch, middle_cache)
    with pytest.raises(BatchError, match="hidden"):
        middle(batch, middle_cache, torch.zeros(2, 64))
    with pytest.raises(ShardingError, match="last PP stage"):
        middle.compute_logits(torch.zeros(3, 64))
    assert not any(t.any() for t in (*first_cache.keys, *middle_cache.keys))


def test_out_of_range_blocks_and_tokens_are_rejected(tiny_llama):
    model = load_model(tiny_llama)
    cache = model.allocate_kv_cache(num_blocks=4, block_size=4)

    with pytest.raises(BatchError, match="block id 4"):
        model(ForwardBatch.build([SequenceChunk((1, 2), 0, (4,))], 4), cache)
    with pytest.raises(BatchError, match="vocabulary"):
        model(ForwardBatch.build([SequenceChunk((1, 384), 0, (0,))], 4), cache)
    with pytest.raises(BatchError, match="KV cache"):
        model(ForwardBatch.build([SequenceChunk((1, 2), 0, (0,))], 8), cache)
    assert not any(t.any() for t in (*cache.keys, *cache.values))
