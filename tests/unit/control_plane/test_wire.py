"""The wire format: round trips, and hostile bytes that must fail with RecordDecodeError only."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.control_plane import RecordDecodeError
from services.control_plane.synthetic import synthetic_records, synthetic_spec
from services.control_plane.wire import (
    MAX_RECORD_BYTES,
    PROTOCOL_VERSION,
    EngineLoad,
    EngineRecord,
    EngineRole,
    EngineState,
    EngineStatus,
    HandshakeRecord,
    compute_compat_hash,
    decode,
    encode,
    validate_identifier,
)
from services.topology import ModelShape, Range


def _engine() -> EngineRecord:
    spec = synthetic_spec("engine-a", pp_size=2, tp_size=2)
    return EngineRecord(
        engine_id=spec.engine_id,
        generation=3,
        role=EngineRole.PREFILL,
        model=spec.model,
        compat_hash=spec.compat_hash,
        shape=ModelShape(num_layers=8, num_kv_heads=8, block_size=16, pp_size=2, tp_size=2),
        endpoint="127.0.0.1:5000",
        pp_aware=True,
        lease_ttl_ms=5000,
        registered_at_ms=1,
    )


def _handshake() -> HandshakeRecord:
    return synthetic_records(_engine())[(1, 1)]


def test_every_record_kind_round_trips_unchanged() -> None:
    status = EngineStatus("engine-a", 3, EngineState.INVALID, ("layer_gap: x",), 7, 99, -1)
    for record in (_engine(), _handshake(), status, EngineLoad(1, 2, 3, 4)):
        assert decode(encode(record), type(record)) == record


def test_a_load_record_without_the_kv_events_seq_decodes_as_unknown() -> None:
    # Written by an engine that predates the field (docs: -1 = unknown, no silence check).
    old = {"queue_depth": 1, "running_requests": 2, "kv_blocks_free": 3, "kv_blocks_total": 4}
    assert decode(_envelope(old), EngineLoad) == EngineLoad(1, 2, 3, 4, kv_events_seq=-1)
    load = EngineLoad(1, 2, 3, 4, kv_events_seq=41)
    assert decode(encode(load), EngineLoad).kv_events_seq == 41


def test_handshake_ranges_and_bytes_survive_the_trip() -> None:
    record = decode(encode(_handshake()), HandshakeRecord)
    assert record.layers == Range(4, 8)
    assert record.kv_heads == Range(4, 8)
    assert record.agent_metadata.startswith(b"synthetic-agent-metadata")


def _envelope(payload: object, version: object = PROTOCOL_VERSION, kind: str = "load") -> bytes:
    return msgpack.packb({"v": version, "k": kind, "d": payload}, use_bin_type=True)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "malformed"),
        (b"\xc1", "malformed"),
        (encode(EngineLoad())[:-1], "malformed"),
        (encode(EngineLoad()) + b"\x00", "malformed"),
        (msgpack.packb([1, 2, 3]), "malformed"),
        (_envelope({}, version=PROTOCOL_VERSION + 1), "wrong_version"),
        (_envelope({}, kind="engine"), "wrong_kind"),
        (_envelope({"queue_depth": "three"}), "schema"),
        (_envelope({"queue_depth": True}), "schema"),
        (_envelope({"unknown_field": 1}), "schema"),
        (_envelope([1]), "schema"),
        (b"\x00" * (MAX_RECORD_BYTES + 1), "oversized"),
        (b"\x91" * 5000 + b"\x00", "malformed"),
    ],
    ids=[
        "empty",
        "reserved-byte",
        "truncated",
        "trailing-bytes",
        "not-a-map",
        "newer-version",
        "other-kind",
        "wrong-type",
        "bool-for-int",
        "unknown-field",
        "body-not-a-map",
        "oversized",
        "nested-too-deep",
    ],
)
def test_hostile_values_are_rejected_with_a_specific_reason(data: bytes, reason: str) -> None:
    with pytest.raises(RecordDecodeError) as caught:
        decode(data, EngineLoad)
    assert caught.value.reason == reason


def test_handshake_with_a_negative_range_is_a_schema_error() -> None:
    raw = msgpack.unpackb(encode(_handshake()), raw=False)
    raw["d"]["layers"] = [5, 2]
    with pytest.raises(RecordDecodeError) as caught:
        decode(msgpack.packb(raw, use_bin_type=True), HandshakeRecord)
    assert caught.value.reason == "schema"


def test_missing_required_field_is_a_schema_error() -> None:
    raw = msgpack.unpackb(encode(_handshake()), raw=False)
    del raw["d"]["agent_metadata"]
    with pytest.raises(RecordDecodeError, match="missing field 'agent_metadata'"):
        decode(msgpack.packb(raw, use_bin_type=True), HandshakeRecord)


def _flat_engine_payload() -> dict[str, object]:
    """An engine record's body as written before the record embedded its shape (and before
    ``max_model_len``): the format every reader keeps reading."""
    return {
        "engine_id": "engine-a",
        "generation": 3,
        "role": "prefill",
        "model": "m",
        "compat_hash": "h",
        "pp_size": 2,
        "tp_size": 2,
        "num_layers": 8,
        "num_kv_heads": 8,
        "block_size": 16,
        "endpoint": "127.0.0.1:5000",
        "pp_aware": True,
        "lease_ttl_ms": 5000,
        "registered_at_ms": 1,
    }


def _engine_defaults() -> dict[str, object]:
    return {
        "engine_kind": "reference",
        "kv_events_endpoint": "",
        "kv_events_replay_endpoint": "",
        "kv_block_bytes": 0,
        "max_loras": 0,
    }


def test_an_engine_records_shape_travels_flat_under_the_old_names() -> None:
    old = decode(_envelope(_flat_engine_payload(), kind="engine"), EngineRecord)
    assert old.shape == ModelShape(
        num_layers=8, num_kv_heads=8, block_size=16, pp_size=2, tp_size=2
    )
    assert old.shape.max_model_len == 0  # absent: unknown
    record = replace(old, shape=replace(old.shape, max_model_len=4096))
    body = msgpack.unpackb(encode(record), raw=False)["d"]
    assert body == {**_flat_engine_payload(), "max_model_len": 4096, **_engine_defaults()}
    assert decode(encode(record), EngineRecord) == record


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"num_layers": None}, "missing field 'num_layers'"),
        ({"tp_size": "2"}, "tp_size: expected int"),
        ({"block_size": True}, "block_size: expected int"),
        ({"shape": {"num_layers": 8}}, "unknown fields \\['shape'\\]"),
        ({"head_size": 128}, "unknown fields \\['head_size'\\]"),
    ],
    ids=["missing", "str-for-int", "bool-for-int", "nested-shape", "unregistered-field"],
)
def test_a_malformed_engine_record_shape_is_a_schema_error(
    change: dict[str, object], message: str
) -> None:
    payload = {**_flat_engine_payload(), **change}
    payload = {name: value for name, value in payload.items() if value is not None}
    with pytest.raises(RecordDecodeError, match=message) as caught:
        decode(_envelope(payload, kind="engine"), EngineRecord)
    assert caught.value.reason == "schema"


def test_an_engine_record_refuses_a_shape_it_would_not_carry() -> None:
    with pytest.raises(ValueError, match="carries only"):
        replace(_engine(), shape=ModelShape(num_layers=8, head_size=128))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_arbitrary_bytes_never_raise_anything_but_record_decode_error(data: bytes) -> None:
    with contextlib.suppress(RecordDecodeError):
        decode(data, HandshakeRecord)


@settings(max_examples=200, deadline=None)
@given(position=st.integers(min_value=0), value=st.integers(min_value=0, max_value=255))
def test_corrupting_any_byte_of_a_record_never_crashes_the_reader(
    position: int, value: int
) -> None:
    data = bytearray(encode(_handshake()))
    data[position % len(data)] = value
    try:
        decoded = decode(bytes(data), HandshakeRecord)
    except RecordDecodeError:
        return
    assert isinstance(decoded, HandshakeRecord)


_HASHED = ModelShape(num_layers=32, num_kv_heads=8, head_size=128, dtype="bfloat16")


def test_compat_hash_of_a_known_shape_is_pinned() -> None:
    """The hash is on the wire (engine records, handshake records): these values were computed
    before the hash took a ModelShape, and must never change within a protocol version."""
    assert compute_compat_hash(_HASHED, model="m", kv_layout="HND") == (
        "fee6eb2075430697eb42422eeb1e650b"
    )
    assert compute_compat_hash(_HASHED, model="m", kv_layout="HND", engine_kind="vllm") == (
        "4d393db654fb6e8b1ac1f773b4e7580c"
    )


def test_compat_hash_changes_with_each_field_that_must_match() -> None:
    reference = compute_compat_hash(_HASHED, model="m", kv_layout="HND")
    for name, other in [
        ("dtype", "float16"),
        ("head_size", 64),
        ("num_layers", 16),
        ("num_kv_heads", 4),
    ]:
        changed = replace(_HASHED, **{name: other})
        assert compute_compat_hash(changed, model="m", kv_layout="HND") != reference, name
    assert compute_compat_hash(_HASHED, model="m2", kv_layout="HND") != reference
    assert compute_compat_hash(_HASHED, model="m", kv_layout="NHD") != reference
    assert compute_compat_hash(_HASHED, model="m", kv_layout="HND", engine_kind="x") != reference
    # The cut, the block size, the context and the vocabulary are not covered.
    cut = replace(_HASHED, pp_size=2, tp_size=2, block_size=16, max_model_len=8, vocab_size=9)
    assert compute_compat_hash(cut, model="m", kv_layout="HND") == reference


@pytest.mark.parametrize("unknown", ["dtype", "head_size", "num_layers", "num_kv_heads"])
def test_compat_hash_refuses_a_shape_that_does_not_know_a_covered_field(unknown: str) -> None:
    blank = "" if unknown == "dtype" else 0
    with pytest.raises(ValueError, match=unknown):
        compute_compat_hash(replace(_HASHED, **{unknown: blank}), model="m", kv_layout="HND")


@pytest.mark.parametrize("bad", ["", "a:b", "a b", "-lead", "x" * 129, "a\nb", "é"])
def test_identifiers_that_would_break_redis_keys_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid engine id"):
        validate_identifier(bad)


def test_encoding_refuses_records_over_the_size_bound() -> None:
    huge = _handshake().__class__(
        **{**_handshake().__dict__, "agent_metadata": b"x" * MAX_RECORD_BYTES}
    )
    with pytest.raises(ValueError, match="exceeds"):
        encode(huge)
