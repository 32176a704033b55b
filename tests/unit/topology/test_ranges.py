"""Tests for ``services.topology.ranges``: ranges, layer splits, KV-head ranges, layouts."""

from __future__ import annotations

from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.topology import EngineLayout, Range, WorkerShard, kv_head_range, split_layers
from services.topology.errors import LayoutError

HEAD_COUNTS = (1, 2, 4, 8, 16)


@st.composite
def layer_splits(draw: st.DrawFn) -> tuple[int, int, list[int]]:
    """``(num_layers, pp_size, partition)`` with any partition into positive parts."""
    num_layers = draw(st.integers(1, 40))
    pp_size = draw(st.integers(1, min(num_layers, 8)))
    cuts = sorted(
        draw(
            st.lists(
                st.integers(1, num_layers - 1),
                min_size=pp_size - 1,
                max_size=pp_size - 1,
                unique=True,
            )
        )
        if pp_size > 1
        else []
    )
    bounds = [0, *cuts, num_layers]
    return num_layers, pp_size, [hi - lo for lo, hi in pairwise(bounds)]


@st.composite
def head_splits(draw: st.DrawFn) -> tuple[int, int]:
    """``(num_kv_heads, tp_size)`` with TP dividing the heads or a multiple of them."""
    num_kv_heads = draw(st.sampled_from(HEAD_COUNTS))
    divisors = [tp for tp in range(1, num_kv_heads + 1) if num_kv_heads % tp == 0]
    multiples = [num_kv_heads * factor for factor in range(2, 5)]
    return num_kv_heads, draw(st.sampled_from(divisors + multiples))


# --- Range ---------------------------------------------------------------------------------------


def test_range_len_iter_and_contains_follow_half_open_convention() -> None:
    r = Range(2, 5)
    assert len(r) == 3
    assert list(r) == [2, 3, 4]
    assert 2 in r
    assert 4 in r
    assert 5 not in r
    assert 1 not in r
    assert "3" not in r
    assert str(r) == "[2,5)"


def test_empty_range_is_allowed_and_has_no_members() -> None:
    r = Range(3, 3)
    assert len(r) == 0
    assert list(r) == []
    assert 3 not in r


@pytest.mark.parametrize(("start", "stop"), [(-1, 2), (3, 2), (-2, -1)])
def test_range_rejects_negative_start_or_stop_before_start(start: int, stop: int) -> None:
    with pytest.raises(LayoutError, match="invalid range"):
        Range(start, stop)


@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        (Range(0, 4), Range(2, 6), Range(2, 4)),
        (Range(2, 6), Range(0, 4), Range(2, 4)),
        (Range(0, 8), Range(3, 5), Range(3, 5)),
        (Range(0, 2), Range(2, 4), None),
        (Range(0, 2), Range(5, 7), None),
        (Range(3, 3), Range(0, 8), None),
    ],
)
def test_range_intersect_is_the_overlap_or_none_when_empty(
    a: Range, b: Range, expected: Range | None
) -> None:
    assert a.intersect(b) == expected


def test_range_shift_moves_global_indices_to_shard_local_ones() -> None:
    assert Range(5, 7).shift(5) == Range(0, 2)
    assert Range(5, 7).shift(3) == Range(2, 4)
    with pytest.raises(LayoutError):
        Range(1, 3).shift(2)


def test_ranges_sort_by_start_then_stop() -> None:
    assert sorted([Range(2, 3), Range(0, 4), Range(0, 1)]) == [
        Range(0, 1),
        Range(0, 4),
        Range(2, 3),
    ]


# --- split_layers --------------------------------------------------------------------------------


def test_split_7_layers_over_3_stages_gives_first_stages_the_extra_layer() -> None:
    assert split_layers(7, 3) == (Range(0, 3), Range(3, 5), Range(5, 7))


def test_split_layers_with_explicit_partition_uses_it_in_stage_order() -> None:
    assert split_layers(7, 3, [1, 1, 5]) == (Range(0, 1), Range(1, 2), Range(2, 7))


def test_split_layers_with_one_stage_is_the_whole_model() -> None:
    assert split_layers(32, 1) == (Range(0, 32),)


def test_split_layers_with_one_layer_per_stage() -> None:
    assert split_layers(3, 3) == (Range(0, 1), Range(1, 2), Range(2, 3))


@given(st.integers(1, 40).flatmap(lambda n: st.tuples(st.just(n), st.integers(1, n))))
def test_default_split_tiles_the_layers_with_sizes_differing_by_at_most_one(
    model: tuple[int, int],
) -> None:
    num_layers, pp_size = model
    stages = split_layers(num_layers, pp_size)
    assert len(stages) == pp_size
    assert stages[0].start == 0
    assert stages[-1].stop == num_layers
    assert all(a.stop == b.start for a, b in pairwise(stages))
    sizes = [len(stage) for stage in stages]
    assert min(sizes) >= 1
    assert max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)


@given(layer_splits())
def test_explicit_partition_tiles_the_layers_with_the_given_sizes(
    split: tuple[int, int, list[int]],
) -> None:
    num_layers, pp_size, partition = split
    stages = split_layers(num_layers, pp_size, partition)
    assert [len(stage) for stage in stages] == partition
    assert [layer for stage in stages for layer in stage] == list(range(num_layers))


@pytest.mark.parametrize(("num_layers", "pp_size"), [(2, 3), (0, 1), (7, 8)])
def test_split_layers_rejects_more_stages_than_layers(num_layers: int, pp_size: int) -> None:
    with pytest.raises(LayoutError, match="cannot split"):
        split_layers(num_layers, pp_size)


@pytest.mark.parametrize("pp_size", [0, -1])
def test_split_layers_rejects_non_positive_pp_size(pp_size: int) -> None:
    with pytest.raises(LayoutError, match="pp_size"):
        split_layers(4, pp_size)


@pytest.mark.parametrize(
    "partition",
    [
        [3, 3],  # too few parts
        [2, 2, 2, 1],  # too many parts
        [3, 3, 2],  # sums to 8
        [3, 2, 1],  # sums to 6
        [4, 3, 0],  # empty stage
        [8, 0, -1],  # negative part
    ],
)
def test_split_layers_rejects_a_partition_that_is_not_pp_size_positive_parts_of_the_layers(
    partition: list[int],
) -> None:
    with pytest.raises(LayoutError, match="partition"):
        split_layers(7, 3, partition)


# --- kv_head_range -------------------------------------------------------------------------------


def test_kv_heads_split_evenly_when_tp_divides_them() -> None:
    assert [kv_head_range(8, 4, rank) for rank in range(4)] == [
        Range(0, 2),
        Range(2, 4),
        Range(4, 6),
        Range(6, 8),
    ]


def test_kv_heads_replicate_over_consecutive_ranks_when_tp_exceeds_them() -> None:
    assert [kv_head_range(2, 8, rank) for rank in range(8)] == [Range(0, 1)] * 4 + [Range(1, 2)] * 4


@given(head_splits())
def test_kv_head_ranges_cover_every_head_the_same_number_of_times_in_order(
    split: tuple[int, int],
) -> None:
    num_kv_heads, tp_size = split
    ranges = [kv_head_range(num_kv_heads, tp_size, rank) for rank in range(tp_size)]
    assert ranges == sorted(ranges)
    heads = [head for r in ranges for head in r]
    replicas = max(1, tp_size // num_kv_heads)
    assert heads == [head for head in range(num_kv_heads) for _ in range(replicas)]
    if tp_size > num_kv_heads:
        assert all(len(r) == 1 for r in ranges)


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), [(8, 3), (6, 4), (4, 6), (3, 2)])
def test_kv_head_range_rejects_tp_that_neither_divides_nor_is_a_multiple_of_the_heads(
    num_kv_heads: int, tp_size: int
) -> None:
    with pytest.raises(LayoutError, match="KV heads"):
        kv_head_range(num_kv_heads, tp_size, 0)


@pytest.mark.parametrize(("tp_size", "tp_rank"), [(4, 4), (4, -1), (0, 0)])
def test_kv_head_range_rejects_a_rank_outside_tp_size(tp_size: int, tp_rank: int) -> None:
    with pytest.raises(LayoutError, match="tp_rank"):
        kv_head_range(8, tp_size, tp_rank)


def test_kv_head_range_rejects_zero_heads() -> None:
    with pytest.raises(LayoutError, match="num_kv_heads"):
        kv_head_range(0, 1, 0)


# --- EngineLayout --------------------------------------------------------------------------------


@settings(max_examples=100, deadline=None)
@given(layer_splits(), head_splits())
def test_uniform_layout_gives_every_worker_its_stage_layers_and_rank_heads(
    layers: tuple[int, int, list[int]], heads: tuple[int, int]
) -> None:
    num_layers, pp_size, partition = layers
    num_kv_heads, tp_size = heads
    layout = EngineLayout.uniform(num_layers, num_kv_heads, pp_size, tp_size, partition)
    stages = split_layers(num_layers, pp_size, partition)
    assert set(layout.shards) == {(pp, tp) for pp in range(pp_size) for tp in range(tp_size)}
    for (pp, tp), shard in layout.shards.items():
        assert shard == WorkerShard(stages[pp], kv_head_range(num_kv_heads, tp_size, tp))
    assert [layout.stage_layers(pp) for pp in range(pp_size)] == list(stages)


def test_uniform_layout_rejects_an_impossible_cut() -> None:
    with pytest.raises(LayoutError):
        EngineLayout.uniform(num_layers=2, num_kv_heads=8, pp_size=3, tp_size=1)
    with pytest.raises(LayoutError):
        EngineLayout.uniform(num_layers=8, num_kv_heads=8, pp_size=1, tp_size=3)
    with pytest.raises(LayoutError):
        EngineLayout.uniform(
            num_layers=7, num_kv_heads=8, pp_size=2, tp_size=1, layer_partition=[3, 3]
        )
