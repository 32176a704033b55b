"""The three types that describe an engine stay field-for-field subsets of each other
(``BackendDescription`` -> ``EngineSpec`` -> ``EngineRecord``), copied by name, each embedding
the model's shape as one ``ModelShape`` of which the record carries a fixed part: a field added
to one and not the others, or to the shape and not decided for the record, fails here instead of
being dropped on the way to Redis."""

from __future__ import annotations

import dataclasses
import typing

from services.control_plane.base import EngineSpec
from services.control_plane.wire import (
    RECORD_SHAPE_FIELDS,
    EngineRecord,
    EngineRole,
    record_shape,
)
from services.engines.backend import SPEC_ONLY_FIELDS, BackendDescription, kv_block_bytes
from services.kv_events.endpoints import advertised
from services.topology import ModelShape


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_record_is_the_spec_plus_what_the_control_plane_assigns() -> None:
    assert names(EngineRecord) - names(EngineSpec) == {
        "generation",
        "lease_ttl_ms",
        "registered_at_ms",
    }
    assert names(EngineSpec) <= names(EngineRecord)


def test_the_spec_is_the_description_plus_what_the_host_knows() -> None:
    assert names(EngineSpec) - names(BackendDescription) == SPEC_ONLY_FIELDS
    # What only the serving side needs stays out of the control plane.
    assert names(BackendDescription) - names(EngineSpec) == {"eos_token_ids"}
    for cls in (BackendDescription, EngineSpec, EngineRecord):
        assert typing.get_type_hints(cls)["shape"] is ModelShape


def test_the_record_carries_a_decided_part_of_the_shape() -> None:
    assert set(RECORD_SHAPE_FIELDS) <= names(ModelShape)
    # What the compat hash covers (head size, dtype), the handshakes carry (the PP partition)
    # or only the serving side needs (the vocabulary) stays out of the record. A new shape
    # field fails here until it is decided (carrying it changes the record's wire format).
    assert names(ModelShape) - set(RECORD_SHAPE_FIELDS) == {
        "vocab_size",
        "head_size",
        "dtype",
        "layer_partition",
    }


def test_every_value_survives_description_to_spec_to_record() -> None:
    description = BackendDescription(
        model="m",
        compat_hash="h",
        shape=ModelShape(
            pp_size=2,
            tp_size=3,
            num_layers=6,
            num_kv_heads=4,
            head_size=8,
            dtype="bfloat16",
            block_size=32,
            vocab_size=100,
            max_model_len=2048,
            layer_partition=(2, 4),
        ),
        eos_token_ids=(1,),
        pp_aware=False,
        engine_kind="vllm",
        kv_block_bytes=7,
        max_loras=2,
    )
    spec = description.spec("prefill-0", EngineRole.PREFILL, "host:1")
    record = spec.record(7, lease_ttl_ms=10_000, registered_at_ms=5)
    for name in names(EngineSpec) - SPEC_ONLY_FIELDS - {"shape"}:
        assert getattr(record, name) == getattr(spec, name) == getattr(description, name)
    assert record.shape == spec.shape == record_shape(description.shape)
    for name in RECORD_SHAPE_FIELDS:
        assert getattr(record.shape, name) == getattr(description.shape, name), name
    assert (record.shape.head_size, record.shape.dtype, record.shape.layer_partition) == (
        0,
        "",
        None,
    )
    assert record.shape.world_size == 6
    assert (record.engine_id, record.role, record.endpoint) == (
        "prefill-0",
        EngineRole.PREFILL,
        "host:1",
    )
    assert (record.generation, record.lease_ttl_ms, record.registered_at_ms) == (7, 10_000, 5)


def test_the_spec_advertises_wildcard_kv_event_endpoints_at_the_engines_host() -> None:
    description = BackendDescription(
        model="m",
        compat_hash="h",
        shape=ModelShape(num_layers=2, num_kv_heads=2, block_size=16, max_model_len=2048),
        eos_token_ids=(1,),
        kv_events_endpoint="tcp://*:5557",
        kv_events_replay_endpoint="tcp://10.1.2.3:5558",
    )
    record = description.spec("decode-0", EngineRole.DECODE, "engine-host:50051").record(
        1, lease_ttl_ms=10_000, registered_at_ms=5
    )
    assert record.kv_events_endpoint == "tcp://engine-host:5557"
    assert record.kv_events_replay_endpoint == "tcp://10.1.2.3:5558"  # bound to one address
    silent = dataclasses.replace(description, kv_events_endpoint="", kv_events_replay_endpoint="")
    spec = silent.spec("decode-0", EngineRole.DECODE, "[::1]:50051")
    assert (spec.kv_events_endpoint, spec.kv_events_replay_endpoint) == ("", "")
    assert advertised("tcp://*:7", "[::1]") == "tcp://[::1]:7"


def test_a_kv_block_is_k_and_v_of_every_layer_and_kv_head() -> None:
    shape = ModelShape(num_layers=3, num_kv_heads=4, head_size=8, dtype="bfloat16", block_size=16)
    assert kv_block_bytes(shape) == 2 * 3 * 4 * 16 * 8 * 2
    assert kv_block_bytes(dataclasses.replace(shape, dtype="unknown")) == 0
