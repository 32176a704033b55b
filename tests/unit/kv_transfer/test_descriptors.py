"""Descriptor lists and index arithmetic, checked by executing them as memory copies.

A loopback stands in for NIXL: each (local index, remote index) pair is copied with
``ctypes.memmove`` between real pools of one process, after checking both ranges lie inside their
pool's buffer. For any pair of layouts drawn by hypothesis, every consumer rank must end up with
exactly its layers and heads, byte for byte, and nothing else written.
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.descriptors import RegionGeometry, slice_descriptors, slice_indices
from services.kv_transfer.planning import notification_plan, reads_for
from services.topology import EngineLayout, PlannedRead, Range
from tests.integration.kv_transfer.harness import check_blocks, fill_pattern

NUM_BLOCKS = 5


def make_pool(layout: EngineLayout, rank: tuple[int, int]) -> KVBlockPool:
    shard = layout.shards[rank]
    return KVBlockPool(KVPoolSpec(shard.layers, shard.kv_heads, NUM_BLOCKS, 2, 3, "float16"))


def loopback_read(
    local: KVBlockPool, remote: KVBlockPool, read: PlannedRead, local_ids, remote_ids
) -> None:
    local_geom = local.geometry()
    remote_geom = remote.geometry()
    peer_layers = remote.spec.layers.intersect(local.spec.layers)
    assert peer_layers is not None
    local_rows = slice_descriptors(local_geom, local.spec.layers, read.kv_heads)
    remote_rows = slice_descriptors(remote_geom, peer_layers, read.kv_heads)
    local_idx = slice_indices(local.spec.layers, read.layers, NUM_BLOCKS, local_ids)
    remote_idx = slice_indices(peer_layers, read.layers, NUM_BLOCKS, remote_ids)
    assert local_idx.dtype == np.int32 and local_idx.shape == remote_idx.shape
    for pool, rows, idx in ((local, local_rows, local_idx), (remote, remote_rows, remote_idx)):
        start = pool.buffer.data_ptr()
        stop = start + pool.spec.total_bytes
        chosen = rows[idx]
        assert (chosen[:, 0] >= start).all() and (chosen[:, 0] + chosen[:, 1] <= stop).all()
    for li, ri in zip(local_idx, remote_idx, strict=True):
        (l_addr, l_len, _), (r_addr, r_len, _) = local_rows[li], remote_rows[ri]
        assert l_len == r_len
        ctypes.memmove(int(l_addr), int(r_addr), int(l_len))


@st.composite
def layouts(draw: st.DrawFn) -> tuple[EngineLayout, EngineLayout]:
    heads = draw(st.sampled_from([1, 2, 4]))
    num_layers = draw(st.integers(1, 5))

    def cut() -> EngineLayout:
        pp = draw(st.integers(1, num_layers))
        cuts: list[int] = []
        if pp > 1:
            inner = st.integers(1, num_layers - 1)
            cuts = sorted(draw(st.sets(inner, min_size=pp - 1, max_size=pp - 1)))
        partition = [b - a for a, b in zip([0, *cuts], [*cuts, num_layers], strict=True)]
        tp = draw(st.sampled_from([1, 2, 4, 8]))
        return EngineLayout.uniform(num_layers, heads, len(partition), tp, partition)

    return cut(), cut()


@settings(max_examples=40, deadline=None)
@given(layouts(), st.permutations(range(NUM_BLOCKS)))
def test_every_consumer_rank_gets_exactly_its_kv(pair, remote_order):
    producer, consumer = pair
    remote_ids = tuple(remote_order[:3])
    producers = {rank: make_pool(producer, rank) for rank in producer.shards}
    for pool in producers.values():
        fill_pattern(pool, remote_ids, seed=9)
    for rank in consumer.shards:
        local = make_pool(consumer, rank)
        local_ids = (4, 0, 2)  # not in order, not the remote ids
        for read in reads_for(rank, consumer, producer):
            loopback_read(
                local, producers[(read.remote_pp, read.remote_tp)], read, local_ids, remote_ids
            )
        assert check_blocks(local, local_ids, seed=9) == []


@settings(max_examples=60, deadline=None)
@given(layouts())
def test_every_producer_rank_is_notified_and_counts_match(pair):
    producer, consumer = pair
    plan = notification_plan(consumer, producer)
    assert set(plan.notifiers) == set(producer.shards)
    assert min(plan.notifiers.values()) >= 1
    sent: dict[tuple[int, int], int] = {}
    for rank in consumer.shards:
        targets = {(r.remote_pp, r.remote_tp) for r in reads_for(rank, consumer, producer)}
        extra = set(plan.notify_only.get(rank, ()))
        assert not targets & extra
        for target in targets | extra:
            sent[target] = sent.get(target, 0) + 1
    assert sent == dict(plan.notifiers)


def test_replicated_producer_heads_are_read_once_and_unread_replicas_notified():
    producer = EngineLayout.uniform(2, 2, 1, 4)  # heads 0,0,1,1 over TP ranks 0..3
    consumer = EngineLayout.uniform(2, 2, 1, 2)
    assert [(r.remote_tp) for r in reads_for((0, 1), consumer, producer)] == [3]
    plan = notification_plan(consumer, producer)
    assert plan.notifiers == {(0, 0): 1, (0, 1): 1, (0, 2): 1, (0, 3): 1}
    assert plan.notify_only == {(0, 0): ((0, 1),), (0, 1): ((0, 2),)}


def test_indices_are_layer_major_then_kv_then_block_order():
    idx = slice_indices(Range(2, 6), Range(3, 5), 10, [7, 1])
    assert idx.tolist() == [27, 21, 37, 31, 47, 41, 57, 51]
    with pytest.raises(ValueError, match="outside the prepared"):
        slice_indices(Range(2, 6), Range(1, 3), 10, [0])
    with pytest.raises(ValueError, match="block ids outside"):
        slice_indices(Range(2, 6), Range(3, 4), 10, [10])


def test_slice_descriptors_cut_heads_within_each_block():
    geometry = RegionGeometry((1000, 5000), Range(0, 1), Range(4, 8), 3, 64, 64, 0, "DRAM")
    rows = slice_descriptors(geometry, Range(0, 1), Range(5, 7))
    assert rows[:, 0].tolist() == [1016, 1080, 1144, 5016, 5080, 5144]
    assert set(rows[:, 1].tolist()) == {32}
    with pytest.raises(ValueError, match="outside the shard"):
        slice_descriptors(geometry, Range(0, 1), Range(3, 5))
