"""The vLLM connector's per-rank transfer plan, executed as memory copies over vLLM's KV layout.

Every rank's KV cache is a real array of the shape vLLM 0.32.0's CPU attention backend
allocates per layer (``cpu_attn.py``: ``[num_blocks, num_kv_heads, block_size, 2 * head_size]``,
``LBHNC``, one NIXL region per layer), for the tiny model's geometry (head_dim 64, float32,
block size 32). Producer caches hold a pattern naming (layer, global head, block); every
consumer rank executes its plan with ``ctypes.memmove`` (a loopback standing in for NIXL) and must
end with exactly its layers x heads for its blocks, each (layer, head, block) copied exactly once
from a producer rank that holds it, nothing else written.
"""

from __future__ import annotations

import ctypes
from collections import Counter
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.control_plane.wire import KV_LAYOUT_HNC, HandshakeRecord
from services.engines.vllm.layouts import vllm_layer_ranges
from services.engines.vllm.transfer_plan import consumer_layout, plan_rank, producer_layout
from services.kv_transfer.descriptors import RegionGeometry
from services.topology import EngineLayout, Range
from services.topology.errors import LayoutError

HEAD_SIZE = 64
BLOCK_SIZE = 32
NUM_BLOCKS = 3
DTYPE = np.float32


class RankCache:
    """One rank's per-layer vLLM KV tensors and the geometry its handshake describes."""

    def __init__(self, layers: Range, heads: Range, fill: bool) -> None:
        self.layers, self.heads = layers, heads
        shape = (NUM_BLOCKS, len(heads), BLOCK_SIZE, 2 * HEAD_SIZE)
        self.caches = [np.full(shape, -1.0, dtype=DTYPE) for _ in layers]
        if fill:
            for i, layer in enumerate(layers):
                for h, head in enumerate(heads):
                    for block in range(NUM_BLOCKS):
                        self.caches[i][block, h] = pattern(layer, head, block)
        block_len = self.caches[0][0].nbytes
        self.geometry = RegionGeometry(
            base_addrs=tuple(cache.ctypes.data for cache in self.caches),
            layers=layers,
            kv_heads=heads,
            num_blocks=NUM_BLOCKS,
            block_len=block_len,
            block_stride=block_len,
            device_id=0,
            memory_type="DRAM",
            regions_per_layer=1,
        )

    def locate(self, address: int, length: int) -> tuple[int, int, int, int]:
        """``(layer, first global head, number of heads, block)`` of a descriptor row."""
        for i, cache in enumerate(self.caches):
            offset = address - cache.ctypes.data
            if offset >= 0 and offset + length <= cache.nbytes:
                block, within = divmod(offset, self.geometry.block_stride)
                head_bytes = self.geometry.head_bytes
                assert within % head_bytes == 0 and length % head_bytes == 0
                assert within + length <= self.geometry.block_len, "row crosses a block"
                return (
                    self.layers.start + i,
                    self.heads.start + within // head_bytes,
                    length // head_bytes,
                    block,
                )
        raise AssertionError(f"row {address:#x}+{length} outside every region")


def pattern(layer: int, head: int, block: int) -> float:
    return float(1_000_000 * (layer + 1) + 1_000 * (head + 1) + block)


def record(rank: tuple[int, int], cache: RankCache) -> HandshakeRecord:
    g = cache.geometry
    return HandshakeRecord(
        engine_id="prefill",
        generation=1,
        pp_rank=rank[0],
        tp_rank=rank[1],
        worker_id=f"w{rank}",
        agent_name=f"a{rank}",
        agent_metadata=b"",
        memory_type=g.memory_type,
        device_id=0,
        region_base_addrs=g.base_addrs,
        num_blocks=NUM_BLOCKS,
        block_len=g.block_len,
        block_stride=g.block_stride,
        block_size=BLOCK_SIZE,
        dtype="float32",
        head_size=HEAD_SIZE,
        kv_layout=KV_LAYOUT_HNC,
        layers=cache.layers,
        kv_heads=cache.heads,
        compat_hash="h",
        extra=b"",
    )


@st.composite
def layer_partition(draw: st.DrawFn, num_layers: int, pp: int) -> tuple[int, ...] | None:
    if pp == 1 or draw(st.booleans()):
        return None  # vLLM's default split
    cuts = sorted(draw(st.sets(st.integers(1, num_layers - 1), min_size=pp - 1, max_size=pp - 1)))
    bounds = [0, *cuts, num_layers]
    return tuple(b - a for a, b in pairwise(bounds))


@st.composite
def engine(draw: st.DrawFn, num_layers: int, num_kv_heads: int) -> EngineLayout:
    pp = draw(st.integers(1, 4))
    tp = draw(st.sampled_from([t for t in (1, 2, 3, 4) if valid_tp(t, num_kv_heads)]))
    partition = draw(layer_partition(num_layers, pp))
    return consumer_layout(vllm_layer_ranges(num_layers, pp, partition), num_kv_heads, tp)


def valid_tp(tp: int, heads: int) -> bool:
    return heads % tp == 0 if tp <= heads else tp % heads == 0


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_consumer_rank_reads_each_layer_head_block_once_from_a_holder(
    data: st.DataObject,
) -> None:
    num_layers = data.draw(st.integers(4, 8), label="layers")  # the tiny model has 7
    num_kv_heads = data.draw(st.sampled_from([1, 2, 4]), label="kv_heads")  # tiny: 2
    producer = data.draw(engine(num_layers, num_kv_heads), label="producer")
    consumer = data.draw(engine(num_layers, num_kv_heads), label="consumer")
    p_caches = {
        rank: RankCache(shard.layers, shard.kv_heads, fill=True)
        for rank, shard in producer.shards.items()
    }
    records = {rank: record(rank, cache) for rank, cache in p_caches.items()}
    notified: Counter[tuple[int, int]] = Counter()
    expected_notifiers: dict[tuple[int, int], int] = {}
    for rank, shard in consumer.shards.items():
        local = RankCache(shard.layers, shard.kv_heads, fill=False)
        plan = plan_rank(rank, consumer, records, local.geometry)
        local_ids = data.draw(st.permutations(range(NUM_BLOCKS)), label="local blocks")
        remote_ids = data.draw(st.permutations(range(NUM_BLOCKS)), label="remote blocks")
        copied: Counter[tuple[int, int, int]] = Counter()
        for read in plan.reads:
            remote = p_caches[read.remote_rank]
            local_idx, remote_idx = plan.block_indices(read, local_ids, remote_ids)
            assert len(local_idx) == len(remote_idx)
            for li, ri in zip(local_idx, remote_idx, strict=True):
                l_addr, l_len, _ = (int(x) for x in read.local_rows[li])
                r_addr, r_len, _ = (int(x) for x in read.remote_rows[ri])
                assert l_len == r_len
                l_layer, l_head, n_heads, l_block = local.locate(l_addr, l_len)
                r_layer, r_head, _, r_block = remote.locate(r_addr, r_len)
                # Same layer and heads on both sides, from a producer rank that holds them.
                assert (l_layer, l_head) == (r_layer, r_head)
                assert r_layer in remote.layers and r_head in remote.heads
                assert remote_ids[local_ids.index(l_block)] == r_block
                for head in range(l_head, l_head + n_heads):
                    copied[(l_layer, head, l_block)] += 1
                ctypes.memmove(l_addr, r_addr, l_len)
            expected_notifiers[read.remote_rank] = read.notifiers
            notified[read.remote_rank] += 1
        for remote_rank, count in plan.notify_only:
            expected_notifiers[remote_rank] = count
            notified[remote_rank] += 1
        wanted = {
            (layer, head, block)
            for layer in shard.layers
            for head in shard.kv_heads
            for block in range(NUM_BLOCKS)
        }
        assert set(copied) == wanted and set(copied.values()) == {1}
        for i, layer in enumerate(shard.layers):
            for h, head in enumerate(shard.kv_heads):
                for block in range(NUM_BLOCKS):
                    source_block = remote_ids[local_ids.index(block)]
                    assert (local.caches[i][block, h] == pattern(layer, head, source_block)).all()
    # Every producer rank is notified by exactly as many consumer ranks as it is told to expect.
    assert set(notified) == set(producer.shards)
    assert notified == Counter(expected_notifiers)


def test_plan_refuses_another_head_geometry() -> None:
    producer = consumer_layout(vllm_layer_ranges(7, 2), 2, 1)
    consumer = consumer_layout(vllm_layer_ranges(7, 1), 2, 1)
    records = {
        rank: record(rank, RankCache(s.layers, s.kv_heads, fill=False))
        for rank, s in producer.shards.items()
    }
    local = RankCache(Range(0, 7), Range(0, 2), fill=False).geometry
    wider = RegionGeometry(**{**local.__dict__, "block_len": local.block_len * 2})
    with pytest.raises(LayoutError, match="bytes per head"):
        plan_rank((0, 0), consumer, records, wider)
    with pytest.raises(LayoutError, match="owns"):
        plan_rank((0, 0), consumer, records, RankCache(Range(0, 3), Range(0, 2), False).geometry)


def test_producer_layout_needs_a_full_grid() -> None:
    cache = RankCache(Range(0, 7), Range(0, 2), fill=False)
    with pytest.raises(LayoutError, match="grid"):
        producer_layout({(0, 1): record((0, 1), cache)}, num_layers=7, num_kv_heads=2)


def test_pp2_prefill_to_tp2_decode_plan_is_two_reads_per_rank() -> None:
    """The tiny model (7 layers: vLLM splits 4/3) from PP=2 into TP=2: each decode rank reads
    its head from both stages; every prefill rank expects two notifications."""
    producer = consumer_layout(vllm_layer_ranges(7, 2), 2, 1)
    consumer = consumer_layout(vllm_layer_ranges(7, 1), 2, 2)
    records = {
        rank: record(rank, RankCache(s.layers, s.kv_heads, fill=False))
        for rank, s in producer.shards.items()
    }
    for tp in (0, 1):
        local = RankCache(Range(0, 7), Range(tp, tp + 1), fill=False).geometry
        plan = plan_rank((0, tp), consumer, records, local)
        assert [(r.remote_rank, r.read.layers, r.notifiers) for r in plan.reads] == [
            ((0, 0), Range(0, 4), 2),
            ((1, 0), Range(4, 7), 2),
        ]
        assert plan.notify_only == ()
