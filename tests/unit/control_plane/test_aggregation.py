"""Aggregation: READY only for a complete, consistent grid; every other case names its reason."""

from __future__ import annotations

from dataclasses import replace

import pytest

from services.control_plane.aggregation import aggregate, rank_field
from services.control_plane.synthetic import synthetic_records, synthetic_spec
from services.control_plane.wire import (
    EngineRecord,
    EngineRole,
    EngineState,
    HandshakeRecord,
    encode,
)
from services.topology import ModelShape, Range


def _engine(
    pp: int = 2, tp: int = 2, layers: int = 7, heads: int = 4, **kw: object
) -> EngineRecord:
    spec = synthetic_spec("engine-a", pp_size=pp, tp_size=tp, num_layers=layers, num_kv_heads=heads)
    fields = dict(
        engine_id=spec.engine_id,
        generation=1,
        role=EngineRole.PREFILL,
        model=spec.model,
        compat_hash=spec.compat_hash,
        shape=ModelShape(
            num_layers=layers, num_kv_heads=heads, block_size=16, pp_size=pp, tp_size=tp
        ),
        endpoint="127.0.0.1:1",
        pp_aware=True,
        lease_ttl_ms=1000,
        registered_at_ms=0,
    )
    fields.update(kw)
    return EngineRecord(**fields)  # type: ignore[arg-type]


def _raw(records: dict[tuple[int, int], HandshakeRecord]) -> dict[str, bytes]:
    return {rank_field(*key): encode(record) for key, record in records.items()}


def _block_len(record: HandshakeRecord, heads: Range) -> int:
    return len(heads) * record.block_size * record.head_size * 2


def test_complete_consistent_grid_is_ready_with_its_layout() -> None:
    engine = _engine()
    verdict = aggregate(engine, _raw(synthetic_records(engine)))
    assert verdict.state is EngineState.READY
    assert verdict.problems == ()
    assert verdict.topology is not None
    assert verdict.topology.layout.stage_layers(0) == Range(0, 4)
    assert verdict.topology.layout.stage_layers(1) == Range(4, 7)
    assert verdict.topology.layout.shards[(1, 1)].kv_heads == Range(2, 4)


def test_replicated_heads_when_tp_exceeds_kv_heads_are_ready() -> None:
    engine = _engine(pp=1, tp=8, layers=4, heads=2)
    verdict = aggregate(engine, _raw(synthetic_records(engine)))
    assert verdict.state is EngineState.READY, verdict.problems


def test_uneven_explicit_layer_split_is_ready() -> None:
    engine = _engine(pp=3, tp=1, layers=7)
    records = synthetic_records(engine, layer_partition=[1, 5, 1])
    verdict = aggregate(engine, _raw(records))
    assert verdict.state is EngineState.READY
    assert verdict.topology is not None
    assert verdict.topology.layout.stage_layers(1) == Range(1, 6)


def test_incomplete_grid_is_pending_and_names_the_missing_ranks() -> None:
    engine = _engine()
    records = synthetic_records(engine)
    del records[(1, 0)]
    verdict = aggregate(engine, _raw(records))
    assert verdict.state is EngineState.PENDING
    assert verdict.missing == ((1, 0),)


def _verdict_after(engine: EngineRecord, rank: tuple[int, int], **changes: object) -> list[str]:
    records = synthetic_records(engine)
    records[rank] = replace(records[rank], **changes)  # type: ignore[arg-type]
    verdict = aggregate(engine, _raw(records))
    assert verdict.state is EngineState.INVALID
    assert verdict.topology is None
    return [p.reason for p in verdict.problems]


def test_hash_mismatch_is_invalid() -> None:
    assert "hash_mismatch" in _verdict_after(_engine(), (0, 1), compat_hash="0" * 32)


def test_block_size_mismatch_is_invalid() -> None:
    engine = _engine()
    record = synthetic_records(engine)[(1, 1)]
    reasons = _verdict_after(engine, (1, 1), block_size=32, block_len=record.block_len * 2)
    assert "block_size_mismatch" in reasons


def test_overlapping_layers_are_invalid() -> None:
    engine = _engine(pp=2, tp=1)
    records = synthetic_records(engine)
    record = records[(1, 0)]
    region_bytes = record.num_blocks * record.block_stride
    last = record.region_base_addrs[-1]
    records[(1, 0)] = replace(
        record,
        layers=Range(3, 7),
        # Two more regions, laid out after the others (overlapping regions are a geometry error).
        region_base_addrs=(*record.region_base_addrs, last + region_bytes, last + 2 * region_bytes),
    )
    verdict = aggregate(engine, _raw(records))
    assert [p.reason for p in verdict.problems] == ["layer_overlap"]


def test_a_layer_owned_by_no_stage_is_a_gap() -> None:
    engine = _engine(pp=2, tp=1)
    records = synthetic_records(engine)
    records[(1, 0)] = replace(
        records[(1, 0)], layers=Range(5, 7), region_base_addrs=records[(1, 0)].region_base_addrs[:4]
    )
    verdict = aggregate(engine, _raw(records))
    assert [p.reason for p in verdict.problems] == ["layer_gap"]


def test_tp_ranks_of_one_stage_on_different_layers_are_invalid() -> None:
    engine = _engine(pp=2, tp=2)
    records = synthetic_records(engine)
    records[(0, 1)] = replace(
        records[(0, 1)], layers=Range(0, 3), region_base_addrs=records[(0, 1)].region_base_addrs[:6]
    )
    reasons = [p.reason for p in aggregate(engine, _raw(records)).problems]
    assert "layer_mismatch" in reasons


def test_head_ranges_that_do_not_tile_are_invalid() -> None:
    engine = _engine(pp=1, tp=2, layers=2, heads=4)
    records = synthetic_records(engine)
    heads = Range(1, 3)
    records[(0, 1)] = replace(
        records[(0, 1)],
        kv_heads=heads,
        block_len=_block_len(records[(0, 1)], heads),
        block_stride=_block_len(records[(0, 1)], heads),
    )
    reasons = [p.reason for p in aggregate(engine, _raw(records)).problems]
    assert reasons == ["head_coverage"]


def test_uneven_replication_is_invalid() -> None:
    engine = _engine(pp=1, tp=4, layers=2, heads=2)
    records = synthetic_records(engine)
    # heads 0,0,0,1 instead of 0,0,1,1
    records[(0, 2)] = replace(records[(0, 2)], kv_heads=Range(0, 1))
    reasons = [p.reason for p in aggregate(engine, _raw(records)).problems]
    assert reasons == ["head_coverage"]


def test_pp_rank_above_zero_from_an_engine_that_is_not_pp_aware_is_invalid() -> None:
    engine = _engine(pp=2, tp=1, pp_aware=False)
    reasons = [p.reason for p in aggregate(engine, _raw(synthetic_records(engine))).problems]
    assert reasons == ["not_pp_aware"]


def test_rank_outside_the_grid_is_invalid() -> None:
    engine = _engine(pp=1, tp=2, layers=2)
    records = synthetic_records(engine)
    raw = _raw(records)
    raw["0:5"] = encode(replace(records[(0, 1)], tp_rank=5))
    raw["zz"] = b"junk"
    reasons = sorted(p.reason for p in aggregate(engine, raw).problems)
    assert reasons == ["rank_out_of_grid", "rank_out_of_grid"]


def test_record_stored_under_another_rank_is_contradictory() -> None:
    engine = _engine(pp=1, tp=2, layers=2)
    records = synthetic_records(engine)
    raw = _raw(records)
    raw["0:0"], raw["0:1"] = raw["0:1"], raw["0:0"]
    reasons = {p.reason for p in aggregate(engine, raw).problems}
    assert reasons == {"contradictory"}


def test_record_of_another_generation_is_contradictory() -> None:
    assert "contradictory" in _verdict_after(_engine(), (0, 0), generation=99)


@pytest.mark.parametrize(
    ("changes", "reason"),
    [
        ({"region_base_addrs": (1,)}, "geometry"),
        ({"block_len": 3}, "geometry"),
        ({"num_blocks": 0}, "geometry"),
        ({"dtype": "int3"}, "geometry"),
        ({"kv_layout": "NHD"}, "geometry"),
    ],
)
def test_inconsistent_region_geometry_is_invalid(changes: dict[str, object], reason: str) -> None:
    assert reason in _verdict_after(_engine(), (0, 0), **changes)


@pytest.mark.parametrize(
    ("value", "reason"),
    [(b"\x00garbage", "malformed"), (b"\x00" * (5 * 1024 * 1024), "oversized")],
)
def test_undecodable_values_make_the_engine_invalid_with_their_reason(
    value: bytes, reason: str
) -> None:
    engine = _engine()
    raw = _raw(synthetic_records(engine))
    raw["1:1"] = value
    verdict = aggregate(engine, raw)
    assert verdict.state is EngineState.INVALID
    assert [(p.reason, p.rank) for p in verdict.problems] == [(reason, (1, 1))]
