"""The three types that describe an engine stay field-for-field subsets of each other
(``BackendDescription``, its model shape flattened, -> ``EngineSpec`` -> ``EngineRecord``),
copied by name: a field added to one and not the others fails here instead of being dropped on
the way to Redis."""

from __future__ import annotations

import dataclasses

from services.control_plane.base import EngineSpec
from services.control_plane.wire import EngineRecord, EngineRole
from services.engines.backend import (
    REGISTERED_SHAPE_FIELDS,
    SPEC_ONLY_FIELDS,
    BackendDescription,
    kv_block_bytes,
)
from services.kv_events.endpoints import advertised
from services.topology import ModelShape


def names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def description_names() -> set[str]:
    """A description's fields with its shape's in place of ``shape``."""
    return (names(BackendDescription) - {"shape"}) | names(ModelShape)


def test_the_record_is_the_spec_plus_what_the_control_plane_assigns() -> None:
    assert names(EngineRecord) - names(EngineSpec) == {
        "generation",
        "lease_ttl_ms",
        "registered_at_ms",
    }
    assert names(EngineSpec) <= names(EngineRecord)


def test_the_spec_is_the_description_plus_what_the_host_knows() -> None:
    assert names(EngineSpec) - description_names() == SPEC_ONLY_FIELDS
    assert names(ModelShape) & names(EngineSpec) == REGISTERED_SHAPE_FIELDS
    # What only the serving side needs (or the compat hash covers) stays out of the control
    # plane.
    assert description_names() - names(EngineSpec) == {
        "vocab_size",
        "eos_token_ids",
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
            block_size=32,
            vocab_size=100,
            max_model_len=2048,
        ),
        eos_token_ids=(1,),
        pp_aware=False,
        engine_kind="vllm",
    )
    spec = description.spec("prefill-0", EngineRole.PREFILL, "host:1")
    record = spec.record(7, lease_ttl_ms=10_000, registered_at_ms=5)
    for name in names(EngineSpec) - SPEC_ONLY_FIELDS:
        source = description.shape if name in REGISTERED_SHAPE_FIELDS else description
        assert getattr(record, name) == getattr(spec, name) == getattr(source, name)
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
