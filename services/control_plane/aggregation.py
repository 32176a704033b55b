"""Aggregation: from an engine's raw per-rank handshake values to READY, PENDING or INVALID.

A pure function over bytes as they were read from Redis, so it serves the publisher (who
announces READY) and every reader (who re-validates what it reads: Redis is a trust boundary)
alike. The rules, each with the ``reason`` it reports:

- each value decodes (``oversized``, ``malformed``, ``wrong_version``, ``wrong_kind``,
  ``schema``) and agrees with its key, engine and generation (``contradictory``);
- each rank lies in the grid (``rank_out_of_grid``); ``pp_rank > 0`` only from a PP-aware engine
  (``not_pp_aware``); each ``(pp, tp)`` present exactly once (``missing_ranks`` while pending);
- one compatibility hash, the engine's (``hash_mismatch``); one block size
  (``block_size_mismatch``); one dtype, head size and layout (``contradictory``);
- the TP ranks of a stage share one layer range (``layer_mismatch``) and the stages tile
  ``[0, num_layers)`` in order (``layer_gap``, ``layer_overlap``);
- within a stage the distinct KV-head ranges tile ``[0, num_kv_heads)`` and every range is held
  by the same number of ranks: plain tiling, or equal replication when TP > KV heads
  (``head_coverage``);
- region geometry is self-consistent (``geometry``).

A grid with any invalid record is INVALID; a valid but incomplete grid is PENDING.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.control_plane.errors import RecordDecodeError
from services.control_plane.wire import (
    KV_REGIONS_PER_LAYER,
    EngineRecord,
    EngineState,
    HandshakeRecord,
    decode,
    kv_block_len,
)
from services.topology import EngineLayout, Range, WorkerShard
from services.topology.ranges import RankKey

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


@dataclass(frozen=True)
class Problem:
    """One reason an engine is not READY: a metric-label ``reason`` and a message for people."""

    reason: str
    message: str
    rank: RankKey | None = None

    def __str__(self) -> str:
        where = f"rank {self.rank}: " if self.rank is not None else ""
        return f"{self.reason}: {where}{self.message}"


@dataclass(frozen=True)
class EngineTopology:
    """A READY engine generation: its record, every worker's handshake and the layout."""

    engine: EngineRecord
    records: Mapping[RankKey, HandshakeRecord]
    layout: EngineLayout


@dataclass(frozen=True)
class Aggregation:
    """The verdict on one engine generation's handshake grid."""

    state: EngineState
    problems: tuple[Problem, ...]
    records: Mapping[RankKey, HandshakeRecord] = field(default_factory=dict)
    """The records that decoded and passed the per-record checks."""
    topology: EngineTopology | None = None
    """Set exactly when ``state`` is READY."""

    @property
    def missing(self) -> tuple[RankKey, ...]:
        return tuple(p.rank for p in self.problems if p.reason == "missing_ranks" and p.rank)


def parse_rank_field(name: str) -> RankKey | None:
    """``"pp:tp"`` to ``(pp, tp)``; ``None`` when it is not two small non-negative integers."""
    parts = name.split(":")
    if len(parts) != 2 or not all(p.isdigit() and len(p) <= 6 for p in parts):
        return None
    return int(parts[0]), int(parts[1])


def rank_field(pp_rank: int, tp_rank: int) -> str:
    """The hash field of ``(pp_rank, tp_rank)``."""
    return f"{pp_rank}:{tp_rank}"


def check_record(engine: EngineRecord, record: HandshakeRecord) -> list[Problem]:
    """Per-record checks against its engine (shared by publisher and readers)."""
    shape = engine.shape
    rank = (record.pp_rank, record.tp_rank)
    problems: list[Problem] = []

    def bad(reason: str, message: str) -> None:
        problems.append(Problem(reason, message, rank))

    if record.engine_id != engine.engine_id or record.generation != engine.generation:
        bad(
            "contradictory",
            f"record of {record.engine_id}@{record.generation} under "
            f"{engine.engine_id}@{engine.generation}",
        )
    if not (0 <= record.pp_rank < shape.pp_size and 0 <= record.tp_rank < shape.tp_size):
        bad("rank_out_of_grid", f"outside the {shape.pp_size} x {shape.tp_size} grid")
    if record.pp_rank > 0 and not engine.pp_aware:
        bad("not_pp_aware", "engine is not PP-aware but published pp_rank > 0")
    if record.compat_hash != engine.compat_hash:
        bad("hash_mismatch", f"compat hash {record.compat_hash} != engine's {engine.compat_hash}")
    if record.block_size != shape.block_size:
        bad("block_size_mismatch", f"block size {record.block_size} != {shape.block_size}")
    if record.layers.stop > shape.num_layers or not record.layers:
        bad("layer_gap", f"layers {record.layers} outside [0,{shape.num_layers})")
    if record.kv_heads.stop > shape.num_kv_heads or not record.kv_heads:
        bad("head_coverage", f"KV heads {record.kv_heads} outside [0,{shape.num_kv_heads})")
    problems.extend(Problem("geometry", m, rank) for m in geometry_errors(record))
    return problems


MAX_BLOCKS_PER_REGION = 1 << 24
"""Upper bound of ``num_blocks`` in a handshake record (real pools hold ~10^3-10^5 blocks);
a consumer builds descriptors for every block, so an unbounded count would exhaust its memory."""
ADDRESS_LIMIT = 1 << 64
_MAX_INTERLEAVED = 8
"""Regions whose extents may overlap one region's extent (interleaved block by block)."""


def geometry_errors(record: HandshakeRecord) -> list[str]:
    """Why a record's regions cannot be read safely; empty when they can.

    Besides self-consistency (the layout's regions per layer and block length), every region
    ``[base, base + (num_blocks - 1) * block_stride + block_len)`` must stay below 2**64 (the
    descriptor arithmetic is unsigned 64-bit and would wrap) and regions must not overlap. A
    record that passes may still point outside what the producer registered with NIXL: the
    consumer's NIXL agent refuses those descriptors when they are prepared, before any read.
    """
    errors = []
    per_layer = KV_REGIONS_PER_LAYER.get(record.kv_layout)
    if per_layer is None:
        return [f"unsupported KV layout {record.kv_layout!r}"]
    if len(record.region_base_addrs) != per_layer * len(record.layers):
        errors.append(
            f"{len(record.region_base_addrs)} regions for {len(record.layers)} layers "
            f"({per_layer} per layer in {record.kv_layout})"
        )
    if any(addr <= 0 for addr in record.region_base_addrs):
        errors.append("region base address <= 0")
    if record.num_blocks <= 0 or record.block_len <= 0 or record.block_stride < record.block_len:
        errors.append(
            f"num_blocks {record.num_blocks}, block_len {record.block_len}, "
            f"stride {record.block_stride}"
        )
    elif record.num_blocks > MAX_BLOCKS_PER_REGION:
        errors.append(f"num_blocks {record.num_blocks} > {MAX_BLOCKS_PER_REGION}")
    else:
        errors.extend(_extent_errors(record))
    element = DTYPE_BYTES.get(record.dtype)
    if element is None:
        errors.append(f"unknown dtype {record.dtype!r}")
    else:
        expected = kv_block_len(
            record.kv_layout,
            heads=len(record.kv_heads),
            block_size=record.block_size,
            head_size=record.head_size,
            element=element,
        )
        if record.block_len != expected:
            errors.append(
                f"block_len {record.block_len} != {expected} (heads x block x head_size in "
                f"{record.kv_layout})"
            )
    return errors


def _extent_errors(record: HandshakeRecord) -> list[str]:
    stride, block_len = record.block_stride, record.block_len
    size = (record.num_blocks - 1) * stride + block_len
    extents = sorted((base, base + size) for base in record.region_base_addrs if base > 0)
    if any(end > ADDRESS_LIMIT for _, end in extents):
        return [f"a region of {size} bytes ends past the 64-bit address space"]
    # Regions may interleave (vLLM's K/V in one tensor: stride 2 x block_len, V one block_len
    # after K) but no block of one may overlap a block of another.
    for index, (base, end) in enumerate(extents):
        later = extents[index + 1 : index + 1 + _MAX_INTERLEAVED]
        for other_base, _ in later:
            if other_base >= end:
                break
            phase = (other_base - base) % stride
            if phase < block_len or stride - phase < block_len:
                return [f"blocks of the regions at {base:#x} and {other_base:#x} overlap"]
        else:
            if len(later) == _MAX_INTERLEAVED and later[-1][0] < end:
                return [f"more than {_MAX_INTERLEAVED} regions interleave"]
    return []


def aggregate(engine: EngineRecord, raw: Mapping[str, bytes]) -> Aggregation:
    """Judge one engine generation from its raw handshake hash (field ``"pp:tp"`` -> value)."""
    shape = engine.shape
    problems: list[Problem] = []
    records: dict[RankKey, HandshakeRecord] = {}
    for name, value in sorted(raw.items()):
        key = parse_rank_field(name)
        if key is None:
            problems.append(Problem("rank_out_of_grid", f"field {name[:40]!r} is not 'pp:tp'"))
            continue
        try:
            record = decode(value, HandshakeRecord)
        except RecordDecodeError as exc:
            problems.append(Problem(exc.reason, str(exc), key))
            continue
        if (record.pp_rank, record.tp_rank) != key:
            problems.append(
                Problem(
                    "contradictory",
                    f"stored under {name} but says {record.pp_rank}:{record.tp_rank}",
                    key,
                )
            )
            continue
        record_problems = check_record(engine, record)
        if record_problems:
            problems.extend(record_problems)
            continue
        records[key] = record
    if problems:
        return Aggregation(EngineState.INVALID, tuple(problems), records)

    missing = [
        (pp, tp)
        for pp in range(shape.pp_size)
        for tp in range(shape.tp_size)
        if (pp, tp) not in records
    ]
    if missing:
        return Aggregation(
            EngineState.PENDING,
            tuple(Problem("missing_ranks", "not published yet", rank) for rank in missing),
            records,
        )

    problems.extend(_consistency_problems(engine, records))
    if problems:
        return Aggregation(EngineState.INVALID, tuple(problems), records)
    layout = EngineLayout(
        num_layers=shape.num_layers,
        num_kv_heads=shape.num_kv_heads,
        pp_size=shape.pp_size,
        tp_size=shape.tp_size,
        shards={key: WorkerShard(r.layers, r.kv_heads) for key, r in records.items()},
    )
    topology = EngineTopology(engine, records, layout)
    return Aggregation(EngineState.READY, (), records, topology)


def _consistency_problems(
    engine: EngineRecord, records: Mapping[RankKey, HandshakeRecord]
) -> list[Problem]:
    shape = engine.shape
    problems: list[Problem] = []
    first = records[(0, 0)]
    for key, record in records.items():
        if (record.dtype, record.head_size, record.kv_layout) != (
            first.dtype,
            first.head_size,
            first.kv_layout,
        ):
            problems.append(
                Problem("contradictory", "dtype, head size or layout differs from rank (0, 0)", key)
            )
    expected_start = 0
    for pp in range(shape.pp_size):
        stage = records[(pp, 0)].layers
        for tp in range(shape.tp_size):
            if records[(pp, tp)].layers != stage:
                problems.append(
                    Problem(
                        "layer_mismatch",
                        f"layers {records[(pp, tp)].layers} != stage's {stage}",
                        (pp, tp),
                    )
                )
        if stage.start > expected_start:
            problems.append(
                Problem(
                    "layer_gap", f"layers [{expected_start},{stage.start}) are owned by no stage"
                )
            )
        elif stage.start < expected_start:
            problems.append(
                Problem("layer_overlap", f"stage {pp} layers {stage} overlap the previous stage")
            )
        expected_start = stage.stop
        problems.extend(
            _head_problems(engine, pp, [records[(pp, tp)].kv_heads for tp in range(shape.tp_size)])
        )
    if expected_start != shape.num_layers:
        problems.append(
            Problem(
                "layer_gap",
                f"layers [{expected_start},{shape.num_layers}) owned by no stage",
            )
        )
    return problems


def _head_problems(engine: EngineRecord, pp: int, ranges: list[Range]) -> list[Problem]:
    shape = engine.shape
    holders: dict[Range, int] = {}
    for heads in ranges:
        holders[heads] = holders.get(heads, 0) + 1
    position = 0
    for heads in sorted(holders):
        if heads.start != position:
            return [
                Problem(
                    "head_coverage",
                    f"stage {pp}: KV-head ranges {sorted(str(r) for r in holders)} do not tile "
                    f"[0,{shape.num_kv_heads})",
                )
            ]
        position = heads.stop
    if position != shape.num_kv_heads:
        return [
            Problem(
                "head_coverage",
                f"stage {pp}: heads [{position},{shape.num_kv_heads}) are held by no rank",
            )
        ]
    if len(set(holders.values())) != 1:
        return [Problem("head_coverage", f"stage {pp}: KV heads are replicated unevenly")]
    return []
