"""Tests for ``services.topology.plan``: every local (layer, KV head) is read exactly once.

The property tests check ``plan_reads`` against an oracle written from the layout conventions
(stage of a layer from the partition's running sum, TP rank of a head from the division rule),
not from ``split_layers`` / ``kv_head_range``, so a bug in those shows up here too.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from itertools import pairwise, product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.topology import EngineLayout, PlannedRead, Range, WorkerShard, plan_reads
from services.topology.errors import LayoutError

HEAD_COUNTS = (1, 2, 4, 8, 16)
MAX_TP = 32


@dataclass(frozen=True)
class Cut:
    """One engine's PP x TP cut of a model, as drawn by the strategies."""

    num_layers: int
    num_kv_heads: int
    tp_size: int
    partition: tuple[int, ...]

    @property
    def pp_size(self) -> int:
        return len(self.partition)

    @property
    def replicas(self) -> int:
        return max(1, self.tp_size // self.num_kv_heads)

    def layout(self) -> EngineLayout:
        return EngineLayout.uniform(
            self.num_layers, self.num_kv_heads, self.pp_size, self.tp_size, self.partition
        )

    def holds(self, pp: int, tp: int, layer: int, head: int) -> bool:
        """Oracle: does worker ``(pp, tp)`` hold ``layer`` and ``head``?"""
        stage_start = sum(self.partition[:pp])
        in_stage = stage_start <= layer < stage_start + self.partition[pp]
        if self.tp_size <= self.num_kv_heads:
            in_rank = head // (self.num_kv_heads // self.tp_size) == tp
        else:
            in_rank = tp // self.replicas == head
        return in_stage and in_rank

    def stage_start(self, pp: int) -> int:
        return sum(self.partition[:pp])


@st.composite
def partitions(draw: st.DrawFn, num_layers: int) -> tuple[int, ...]:
    """Any partition of ``num_layers`` into positive parts, uneven ones included."""
    pp_size = draw(st.integers(1, min(num_layers, 6)))
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
    return tuple(hi - lo for lo, hi in pairwise(bounds))


def tp_sizes(num_kv_heads: int, *, min_replicas: int = 1) -> st.SearchStrategy[int]:
    """TP sizes that divide the heads, or are a multiple of them (replication)."""
    divisors = [tp for tp in range(1, num_kv_heads + 1) if num_kv_heads % tp == 0]
    multiples = [num_kv_heads * f for f in range(2, 5) if num_kv_heads * f <= MAX_TP]
    choices = [tp for tp in divisors + multiples if tp // num_kv_heads >= min_replicas]
    return st.sampled_from(choices)


@st.composite
def cuts(draw: st.DrawFn, num_layers: int, num_kv_heads: int, *, min_replicas: int = 1) -> Cut:
    tp_size = draw(tp_sizes(num_kv_heads, min_replicas=min_replicas))
    return Cut(num_layers, num_kv_heads, tp_size, draw(partitions(num_layers)))


@st.composite
def cut_pairs(draw: st.DrawFn, *, min_remote_replicas: int = 1) -> tuple[Cut, Cut]:
    """``(local, remote)`` cuts of one random model."""
    num_layers = draw(st.integers(1, 40))
    num_kv_heads = draw(st.sampled_from(HEAD_COUNTS))
    local = draw(cuts(num_layers, num_kv_heads))
    remote = draw(cuts(num_layers, num_kv_heads, min_replicas=min_remote_replicas))
    return local, remote


def covered(reads: tuple[PlannedRead, ...]) -> Counter[tuple[int, int]]:
    """How many times each global ``(layer, kv_head)`` is read."""
    return Counter(
        (layer, head) for read in reads for layer in read.layers for head in read.kv_heads
    )


def shard_cells(shard: WorkerShard) -> Counter[tuple[int, int]]:
    return Counter(product(shard.layers, shard.kv_heads))


def within(inner: Range, size: int) -> bool:
    return 0 <= inner.start < inner.stop <= size


# --- properties ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(cut_pairs(), st.integers(0, 64))
def test_every_local_layer_and_head_is_read_exactly_once_from_a_worker_that_holds_it(
    pair: tuple[Cut, Cut], replica_hint: int
) -> None:
    local_cut, remote_cut = pair
    remote = remote_cut.layout()
    for local in local_cut.layout().shards.values():
        reads = plan_reads(local, remote, replica_hint=replica_hint)

        assert covered(reads) == shard_cells(local)
        assert [(r.remote_pp, r.kv_heads) for r in reads] == sorted(
            (r.remote_pp, r.kv_heads) for r in reads
        )
        for read in reads:
            assert read.local_shard == local
            assert read.remote_shard == remote.shards[(read.remote_pp, read.remote_tp)]
            assert all(
                remote_cut.holds(read.remote_pp, read.remote_tp, layer, head)
                for layer in read.layers
                for head in read.kv_heads
            )
            remote_shard, local_shard = read.remote_shard, read.local_shard
            assert within(read.remote_layers, len(remote_shard.layers))
            assert within(read.remote_heads, len(remote_shard.kv_heads))
            assert within(read.local_layers, len(local_shard.layers))
            assert within(read.local_heads, len(local_shard.kv_heads))
            # Shard-relative indices point back at the same global layers.
            stage_start = remote_cut.stage_start(read.remote_pp)
            assert read.remote_layers.start + stage_start == read.layers.start
            assert read.local_layers.start + local.layers.start == read.layers.start


@settings(max_examples=150, deadline=None)
@given(cut_pairs(min_remote_replicas=2))
def test_replica_hints_spread_reads_over_every_replica_of_a_head(pair: tuple[Cut, Cut]) -> None:
    local_cut, remote_cut = pair
    remote = remote_cut.layout()
    replicas = remote_cut.replicas
    for local in local_cut.layout().shards.values():
        chosen: dict[tuple[int, int], list[int]] = {}
        for hint in range(replicas):
            for read in plan_reads(local, remote, replica_hint=hint):
                assert len(read.kv_heads) == 1
                chosen.setdefault((read.remote_pp, read.kv_heads.start), []).append(read.remote_tp)
        assert chosen
        for (_, head), tps in chosen.items():
            # Each hint picks a different replica, and together they use all of them.
            assert sorted(tps) == list(range(head * replicas, (head + 1) * replicas))


@settings(max_examples=100, deadline=None)
@given(cut_pairs(min_remote_replicas=2), st.integers(0, 1000))
def test_replica_choice_depends_only_on_hint_modulo_replicas(
    pair: tuple[Cut, Cut], hint: int
) -> None:
    local_cut, remote_cut = pair
    remote = remote_cut.layout()
    local = local_cut.layout().shards[(0, 0)]
    assert plan_reads(local, remote, replica_hint=hint) == plan_reads(
        local, remote, replica_hint=hint % remote_cut.replicas
    )


# --- examples ------------------------------------------------------------------------------------


def test_producer_pp2_tp1_to_consumer_pp1_tp2_reads_both_stages_for_its_head() -> None:
    producer = EngineLayout.uniform(num_layers=4, num_kv_heads=2, pp_size=2, tp_size=1)
    consumer = EngineLayout.uniform(num_layers=4, num_kv_heads=2, pp_size=1, tp_size=2)

    reads = plan_reads(consumer.shards[(0, 1)], producer)

    assert [(r.remote_pp, r.remote_tp, r.layers, r.kv_heads) for r in reads] == [
        (0, 0, Range(0, 2), Range(1, 2)),
        (1, 0, Range(2, 4), Range(1, 2)),
    ]
    assert [r.remote_layers for r in reads] == [Range(0, 2), Range(0, 2)]
    assert [r.local_layers for r in reads] == [Range(0, 2), Range(2, 4)]
    assert [r.remote_heads for r in reads] == [Range(1, 2), Range(1, 2)]
    assert [r.local_heads for r in reads] == [Range(0, 1), Range(0, 1)]


def test_producer_tp4_to_consumer_tp2_reads_two_producer_ranks_into_one_slice() -> None:
    producer = EngineLayout.uniform(num_layers=6, num_kv_heads=8, pp_size=1, tp_size=4)
    consumer = EngineLayout.uniform(num_layers=6, num_kv_heads=8, pp_size=1, tp_size=2)

    reads = plan_reads(consumer.shards[(0, 1)], producer)

    assert [(r.remote_tp, r.kv_heads, r.remote_heads, r.local_heads) for r in reads] == [
        (2, Range(4, 6), Range(0, 2), Range(0, 2)),
        (3, Range(6, 8), Range(0, 2), Range(2, 4)),
    ]
    assert all(r.layers == Range(0, 6) for r in reads)


def test_consumer_tp4_from_producer_tp2_reads_part_of_one_producer_slice() -> None:
    producer = EngineLayout.uniform(num_layers=6, num_kv_heads=8, pp_size=1, tp_size=2)
    consumer = EngineLayout.uniform(num_layers=6, num_kv_heads=8, pp_size=1, tp_size=4)

    (read,) = plan_reads(consumer.shards[(0, 3)], producer)

    assert (read.remote_tp, read.kv_heads) == (1, Range(6, 8))
    assert (read.remote_heads, read.local_heads) == (Range(2, 4), Range(0, 2))


def test_uneven_pp_on_both_sides_intersects_layer_ranges() -> None:
    producer = EngineLayout.uniform(num_layers=7, num_kv_heads=1, pp_size=3, tp_size=1)
    consumer = EngineLayout.uniform(
        num_layers=7, num_kv_heads=1, pp_size=2, tp_size=1, layer_partition=[2, 5]
    )

    reads = plan_reads(consumer.shards[(1, 0)], producer)

    # Producer stages [0,3) [3,5) [5,7); consumer stage 1 holds [2,7).
    assert [(r.remote_pp, r.layers) for r in reads] == [
        (0, Range(2, 3)),
        (1, Range(3, 5)),
        (2, Range(5, 7)),
    ]
    assert [r.remote_layers for r in reads] == [Range(2, 3), Range(0, 2), Range(0, 2)]
    assert [r.local_layers for r in reads] == [Range(0, 1), Range(1, 3), Range(3, 5)]


def test_remote_tp8_with_2_kv_heads_reads_one_replica_per_head_chosen_by_hint() -> None:
    remote = EngineLayout.uniform(num_layers=4, num_kv_heads=2, pp_size=1, tp_size=8)
    local = EngineLayout.uniform(num_layers=4, num_kv_heads=2, pp_size=1, tp_size=1)
    shard = local.shards[(0, 0)]

    by_hint = {
        hint: [(r.remote_tp, r.kv_heads) for r in plan_reads(shard, remote, replica_hint=hint)]
        for hint in range(5)
    }

    assert by_hint[0] == [(0, Range(0, 1)), (4, Range(1, 2))]
    assert by_hint[1] == [(1, Range(0, 1)), (5, Range(1, 2))]
    assert by_hint[3] == [(3, Range(0, 1)), (7, Range(1, 2))]
    assert by_hint[4] == by_hint[0]
    reads = plan_reads(shard, remote, replica_hint=2)
    assert [(r.remote_heads, r.local_heads) for r in reads] == [
        (Range(0, 1), Range(0, 1)),
        (Range(0, 1), Range(1, 2)),
    ]


def test_default_replica_hint_reads_the_first_replica() -> None:
    remote = EngineLayout.uniform(num_layers=2, num_kv_heads=2, pp_size=1, tp_size=4)
    shard = WorkerShard(Range(0, 2), Range(1, 2))

    (read,) = plan_reads(shard, remote)

    assert read.remote_tp == 2


def test_local_tp_larger_than_heads_reads_only_its_replicated_head() -> None:
    local = EngineLayout.uniform(num_layers=3, num_kv_heads=2, pp_size=1, tp_size=4)
    shard = local.shards[(0, 3)]
    assert shard.kv_heads == Range(1, 2)

    (from_tp2,) = plan_reads(shard, EngineLayout.uniform(3, 2, pp_size=1, tp_size=2))
    (from_tp1,) = plan_reads(shard, EngineLayout.uniform(3, 2, pp_size=1, tp_size=1))

    assert (from_tp2.remote_tp, from_tp2.remote_heads, from_tp2.local_heads) == (
        1,
        Range(0, 1),
        Range(0, 1),
    )
    assert (from_tp1.remote_tp, from_tp1.remote_heads, from_tp1.local_heads) == (
        0,
        Range(1, 2),
        Range(0, 1),
    )


def test_same_layout_on_both_sides_reads_the_matching_worker_whole() -> None:
    layout = EngineLayout.uniform(num_layers=7, num_kv_heads=4, pp_size=3, tp_size=2)

    for (pp, tp), shard in layout.shards.items():
        (read,) = plan_reads(shard, layout)
        assert (read.remote_pp, read.remote_tp) == (pp, tp)
        assert read.remote_layers == read.local_layers == Range(0, len(shard.layers))
        assert read.remote_heads == read.local_heads == Range(0, len(shard.kv_heads))


def test_empty_local_shard_plans_no_reads() -> None:
    remote = EngineLayout.uniform(num_layers=4, num_kv_heads=2, pp_size=2, tp_size=2)
    assert plan_reads(WorkerShard(Range(2, 2), Range(0, 2)), remote) == ()
    assert plan_reads(WorkerShard(Range(0, 4), Range(1, 1)), remote) == ()


# --- errors --------------------------------------------------------------------------------------


def layout_of(
    shards: dict[tuple[int, int], WorkerShard], *, num_layers: int, num_kv_heads: int
) -> EngineLayout:
    """An ``EngineLayout`` built by hand, bypassing ``uniform``'s checks."""
    pp_size = 1 + max(pp for pp, _ in shards)
    tp_size = 1 + max(tp for _, tp in shards)
    return EngineLayout(num_layers, num_kv_heads, pp_size, tp_size, shards)


@pytest.mark.parametrize(
    "local",
    [
        WorkerShard(Range(0, 9), Range(0, 2)),  # one layer too many
        WorkerShard(Range(8, 9), Range(0, 2)),  # layer past the end
        WorkerShard(Range(0, 8), Range(0, 3)),  # one head too many
        WorkerShard(Range(0, 8), Range(2, 4)),  # heads past the end
    ],
)
def test_local_shard_outside_the_remote_model_raises(local: WorkerShard) -> None:
    remote = EngineLayout.uniform(num_layers=8, num_kv_heads=2, pp_size=2, tp_size=2)
    with pytest.raises(LayoutError, match="outside the remote model"):
        plan_reads(local, remote)


def test_remote_stages_with_a_layer_gap_raise() -> None:
    heads = Range(0, 2)
    remote = layout_of(
        {(0, 0): WorkerShard(Range(0, 3), heads), (1, 0): WorkerShard(Range(4, 6), heads)},
        num_layers=6,
        num_kv_heads=2,
    )
    with pytest.raises(LayoutError, match="cover 5 of the 6 layers"):
        plan_reads(WorkerShard(Range(0, 6), heads), remote)


def test_remote_stages_that_overlap_raise() -> None:
    heads = Range(0, 2)
    remote = layout_of(
        {(0, 0): WorkerShard(Range(0, 4), heads), (1, 0): WorkerShard(Range(3, 6), heads)},
        num_layers=6,
        num_kv_heads=2,
    )
    with pytest.raises(LayoutError, match="stages overlap"):
        plan_reads(WorkerShard(Range(0, 6), heads), remote)


def test_remote_stages_whose_overlap_and_gap_cancel_out_still_raise() -> None:
    # [0,3) [2,4) [5,6): layer 2 held twice, layer 4 by no one; 3 + 2 + 1 == 6 layers.
    heads = Range(0, 1)
    remote = layout_of(
        {
            (0, 0): WorkerShard(Range(0, 3), heads),
            (1, 0): WorkerShard(Range(2, 4), heads),
            (2, 0): WorkerShard(Range(5, 6), heads),
        },
        num_layers=6,
        num_kv_heads=1,
    )
    with pytest.raises(LayoutError, match="stages overlap"):
        plan_reads(WorkerShard(Range(0, 6), heads), remote)


def test_remote_tp_ranks_of_one_stage_on_different_layers_raise() -> None:
    remote = layout_of(
        {
            (0, 0): WorkerShard(Range(0, 4), Range(0, 1)),
            (0, 1): WorkerShard(Range(0, 3), Range(1, 2)),
        },
        num_layers=4,
        num_kv_heads=2,
    )
    with pytest.raises(LayoutError, match=r"remote \(0,1\) layers"):
        plan_reads(WorkerShard(Range(0, 4), Range(0, 2)), remote)


@pytest.mark.parametrize(
    "head_ranges",
    [
        [Range(0, 2), Range(1, 2)],  # second rank inside the first
        [Range(0, 3), Range(2, 4)],  # partial overlap
        [Range(1, 3), Range(0, 2), Range(3, 4)],  # overlap with ranks out of order
    ],
)
def test_overlapping_remote_head_ranges_raise(head_ranges: list[Range]) -> None:
    layers = Range(0, 4)
    remote = layout_of(
        {(0, tp): WorkerShard(layers, heads) for tp, heads in enumerate(head_ranges)},
        num_layers=4,
        num_kv_heads=4,
    )
    with pytest.raises(LayoutError, match="head ranges overlap"):
        plan_reads(WorkerShard(layers, Range(0, 4)), remote)


def test_remote_head_ranges_with_a_gap_raise() -> None:
    layers = Range(0, 4)
    remote = layout_of(
        {(0, 0): WorkerShard(layers, Range(0, 1)), (0, 1): WorkerShard(layers, Range(2, 4))},
        num_layers=4,
        num_kv_heads=4,
    )
    with pytest.raises(LayoutError, match="covers 3 of the 4 KV heads"):
        plan_reads(WorkerShard(layers, Range(0, 4)), remote)


def test_remote_stages_listed_out_of_layer_order_still_plan_every_layer_once() -> None:
    heads = Range(0, 1)
    remote = layout_of(
        {(0, 0): WorkerShard(Range(3, 5), heads), (1, 0): WorkerShard(Range(0, 3), heads)},
        num_layers=5,
        num_kv_heads=1,
    )
    local = WorkerShard(Range(0, 5), heads)

    reads = plan_reads(local, remote)

    assert covered(reads) == shard_cells(local)
    assert [(r.remote_pp, r.layers) for r in reads] == [(0, Range(3, 5)), (1, Range(0, 3))]


def test_remote_gap_outside_the_local_layers_does_not_stop_planning() -> None:
    heads = Range(0, 1)
    remote = layout_of(
        {(0, 0): WorkerShard(Range(0, 3), heads), (1, 0): WorkerShard(Range(4, 6), heads)},
        num_layers=6,
        num_kv_heads=1,
    )

    (read,) = plan_reads(WorkerShard(Range(0, 3), heads), remote)

    assert (read.remote_pp, read.layers) == (0, Range(0, 3))
