"""Synthetic but self-consistent handshake records, for benchmarks and tests of the control plane.

They describe a real geometry (HND blocks, two regions per layer) with placeholder NIXL agent
metadata: nothing behind them can be read over NIXL. Workers publish real records, built by the
KV data plane from their registered block pools.
"""

from __future__ import annotations

from services.control_plane.aggregation import DTYPE_BYTES
from services.control_plane.base import EngineSpec
from services.control_plane.wire import (
    EngineRecord,
    EngineRole,
    HandshakeRecord,
    compute_compat_hash,
    record_shape,
)
from services.topology import EngineLayout, ModelShape

SYNTHETIC_MODEL = "synthetic/llama-like"


def synthetic_spec(
    engine_id: str,
    *,
    pp_size: int = 1,
    tp_size: int = 1,
    num_layers: int = 8,
    num_kv_heads: int = 8,
    head_size: int = 128,
    block_size: int = 16,
    dtype: str = "bfloat16",
    role: EngineRole = EngineRole.PREFILL,
    pp_aware: bool = True,
) -> EngineSpec:
    """An :class:`EngineSpec` whose compat hash matches :func:`synthetic_records`."""
    shape = ModelShape(
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_size=head_size,
        dtype=dtype,
        block_size=block_size,
        pp_size=pp_size,
        tp_size=tp_size,
    )
    return EngineSpec(
        engine_id=engine_id,
        role=role,
        model=SYNTHETIC_MODEL,
        compat_hash=compute_compat_hash(shape, model=SYNTHETIC_MODEL, kv_layout="HND"),
        shape=record_shape(shape),
        endpoint=f"127.0.0.1:0/{engine_id}",
        pp_aware=pp_aware,
    )


def synthetic_records(
    engine: EngineRecord,
    *,
    head_size: int = 128,
    dtype: str = "bfloat16",
    num_blocks: int = 1024,
    layer_partition: list[int] | None = None,
    worker_prefix: str = "worker",
) -> dict[tuple[int, int], HandshakeRecord]:
    """One consistent record per ``(pp, tp)`` of ``engine``'s grid."""
    shape = engine.shape
    layout = EngineLayout.uniform(
        shape.num_layers, shape.num_kv_heads, shape.pp_size, shape.tp_size, layer_partition
    )
    records = {}
    for (pp, tp), shard in layout.shards.items():
        block_len = len(shard.kv_heads) * shape.block_size * head_size * DTYPE_BYTES[dtype]
        base = 0x10_0000_0000 * (1 + pp * shape.tp_size + tp)
        region_size = block_len * num_blocks
        records[(pp, tp)] = HandshakeRecord(
            engine_id=engine.engine_id,
            generation=engine.generation,
            pp_rank=pp,
            tp_rank=tp,
            worker_id=f"{worker_prefix}-{engine.engine_id}-{engine.generation}-{pp}-{tp}",
            agent_name=f"{engine.engine_id}-g{engine.generation}-pp{pp}-tp{tp}",
            agent_metadata=b"synthetic-agent-metadata:" + bytes(64),
            memory_type="DRAM",
            device_id=0,
            region_base_addrs=tuple(base + i * region_size for i in range(2 * len(shard.layers))),
            num_blocks=num_blocks,
            block_len=block_len,
            block_stride=block_len,
            block_size=shape.block_size,
            dtype=dtype,
            head_size=head_size,
            kv_layout="HND",
            layers=shard.layers,
            kv_heads=shard.kv_heads,
            compat_hash=engine.compat_hash,
        )
    return records
