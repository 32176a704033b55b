"""The block pool's HND layout, and that its handshake passes the control plane's checks."""

from __future__ import annotations

import pytest

from services.control_plane.aggregation import check_record
from services.control_plane.wire import EngineRecord, EngineRole, decode, encode
from services.kv_transfer.block_pool import KVBlockPool, KVPoolSpec
from services.kv_transfer.errors import PoolExhaustedError
from services.kv_transfer.protocol import WorkerIdentity
from services.topology import ModelShape, Range
from tests.unit.kv_transfer.fakes import FakeTransport

SPEC = KVPoolSpec(
    Range(2, 5), Range(4, 8), num_blocks=6, block_size=16, head_size=8, dtype="bfloat16"
)


def test_one_block_of_one_layer_for_a_head_slice_is_contiguous():
    pool = KVBlockPool(SPEC)
    layout = pool.geometry()
    assert layout.block_len == 4 * 16 * 8 * 2 and layout.block_stride == layout.block_len
    head_bytes = SPEC.head_bytes
    for region, tensor in enumerate(pool.regions()):
        base = layout.base_addrs[region]
        assert tensor.is_contiguous() and tensor.shape == (6, 4, 16, 8)
        for block in (0, 5):
            for head in range(4):
                assert (
                    tensor[block, head].data_ptr()
                    == base + block * layout.block_len + head * head_bytes
                )
    k3, v3 = pool.layer_kv(3)
    assert k3.data_ptr() == layout.base_addrs[2] and v3.data_ptr() == layout.base_addrs[3]
    with pytest.raises(IndexError):
        pool.layer_kv(5)


def test_handshake_record_passes_the_control_plane_checks_and_the_wire():
    pool = KVBlockPool(SPEC)
    transport = FakeTransport(pool, WorkerIdentity("prefill-0", 3, 1, 1))
    record = transport.handshake_record(worker_id="w1", compat_hash="h" * 32)
    engine = EngineRecord(
        engine_id="prefill-0",
        generation=3,
        role=EngineRole.PREFILL,
        model="m",
        compat_hash="h" * 32,
        shape=ModelShape(num_layers=5, num_kv_heads=8, block_size=16, pp_size=2, tp_size=2),
        endpoint="x:1",
        pp_aware=True,
        lease_ttl_ms=1000,
        registered_at_ms=0,
    )
    assert check_record(engine, record) == []
    assert decode(encode(record), type(record)) == record
    assert record.memory_type == "DRAM" and record.kv_layout == "HND"


def test_allocation_goes_through_the_reference_counts():
    pool = KVBlockPool(SPEC)
    blocks = pool.allocate(6)
    with pytest.raises(PoolExhaustedError):
        pool.allocate(1)
    pool.incref(blocks[:1])
    pool.free(blocks)
    assert pool.free_count == 5
    pool.free(blocks[:1])
    assert pool.free_count == pool.num_blocks


def test_invalid_specs_are_refused():
    with pytest.raises(ValueError, match="dtype"):
        KVPoolSpec(Range(0, 1), Range(0, 1), 1, 1, 1, dtype="int8")
    with pytest.raises(ValueError, match="empty shard"):
        KVPoolSpec(Range(0, 0), Range(0, 1), 1, 1, 1)
