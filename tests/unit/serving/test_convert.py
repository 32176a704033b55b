"""Proto <-> backend dataclass conversions: round trips and rejection of malformed fields."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.engines import sampling_fields
from services.engines.errors import InvalidRequest
from services.engines.requests import (
    DecodeRequest,
    FinishReason,
    KVHandle,
    PrefillRequest,
    PrefillResult,
    RequestLimits,
    SamplingParams,
    TokenDelta,
    Usage,
)
from services.proto_gen.pdserve.v1 import decode_pb2, prefill_pb2, types_pb2
from services.serving.wire import convert, fields
from tests.unit.sampling_examples import EVERY_FIELD_SET

LIMITS = RequestLimits(vocab_size=1000, max_model_len=64)

HANDLE = KVHandle(
    producer_engine_id="prefill-a1",
    generation=1_700_000_000_123,
    request_id="req-1",
    block_ids=(3, 4, 9),
    num_tokens=5,
    lease_expires_at_s=1_800_000_000.5,
    extra=b'{"k": 1}',
)


FLOATS = [0.0, 0.05, 0.5, 0.7, 1.0, 1.3]
"""Short decimals, as a client writes them (float32 on the wire reads back as written)."""
PENALTIES = [-2.0, -0.5, 0.0, 0.3, 1.5, 2.0]
EVERY_FIELD = {
    "max_tokens": st.integers(1, 4096),
    "temperature": st.sampled_from(FLOATS),
    "top_p": st.sampled_from([0.1, 0.9, 0.95, 1.0]),
    "top_k": st.integers(0, 100),
    "seed": st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    "stop": st.lists(st.text(min_size=1, max_size=8), max_size=4).map(tuple),
    "stop_token_ids": st.lists(st.integers(0, 999), max_size=8).map(tuple),
    "ignore_eos": st.booleans(),
    "presence_penalty": st.sampled_from(PENALTIES),
    "frequency_penalty": st.sampled_from(PENALTIES),
    "repetition_penalty": st.sampled_from([0.5, 1.0, 1.2, 2.0]),
    "min_p": st.sampled_from([0.0, 0.05, 0.5, 1.0]),
    "min_tokens": st.integers(0, 64),
    "logit_bias": st.dictionaries(
        st.integers(0, 999), st.sampled_from([-100.0, -2.5, 0.0, 0.5, 100.0]), max_size=6
    ).map(lambda bias: tuple(sorted(bias.items()))),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "prompt_logprobs": st.one_of(st.none(), st.integers(0, 20)),
    "include_stop_str_in_output": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "spaces_between_special_tokens": st.booleans(),
    "n": st.integers(1, 128),
    "output_tokens_in_prompt": st.integers(0, 1000),
    "structured_outputs": st.sampled_from(["", '{"choice":["a","b"]}', '{"regex":"[0-9]+"}']),
}
"""A strategy for every field of :class:`SamplingParams` (checked below)."""

sampling_params = st.builds(SamplingParams, **EVERY_FIELD).filter(
    lambda sampling: sampling.min_tokens <= sampling.max_tokens
)


def test_the_dataclass_and_the_proto_list_the_same_fields_and_the_round_trip_varies_each() -> None:
    proto = [field.name for field in types_pb2.SamplingParams.DESCRIPTOR.fields]
    assert [field.name for field in dataclasses.fields(SamplingParams)] == proto
    assert set(sampling_fields.RULES) <= set(proto)
    assert list(EVERY_FIELD) == proto
    unset = [
        name for name in proto if getattr(EVERY_FIELD_SET, name) == sampling_fields.DEFAULTS[name]
    ]
    assert unset == []


def test_a_sampling_with_every_field_set_round_trips() -> None:
    wire = types_pb2.SamplingParams.FromString(
        fields.sampling_to_proto(EVERY_FIELD_SET).SerializeToString()
    )
    assert [field.name for field, _ in wire.ListFields()] == list(EVERY_FIELD)
    assert fields.sampling_from_proto(wire, LIMITS) == EVERY_FIELD_SET


@given(sampling_params)
def test_sampling_round_trips(sampling: SamplingParams) -> None:
    wire = types_pb2.SamplingParams.FromString(
        fields.sampling_to_proto(sampling).SerializeToString()
    )
    assert fields.sampling_from_proto(wire, LIMITS) == sampling


def test_the_defaults_round_trip_and_a_bias_beyond_vllms_bound_is_clamped() -> None:
    wire = fields.sampling_to_proto(SamplingParams())
    assert fields.sampling_from_proto(wire) == SamplingParams()
    assert not wire.HasField("seed") and not wire.HasField("repetition_penalty")
    clamped = fields.sampling_from_proto(
        types_pb2.SamplingParams(max_tokens=1, logit_bias={9: 250.0, 3: -0.7})
    )
    assert clamped.logit_bias == ((3, -0.7), (9, 100.0))


def test_the_shared_sampling_message_is_copied_into_each_request() -> None:
    sampling = SamplingParams(max_tokens=7, temperature=0.5, stop=("x",))
    first = convert.prefill_request_to_proto(PrefillRequest("req-a", (1, 2), sampling))
    first.sampling.max_tokens = 99  # a change to one request's copy
    second = convert.prefill_request_to_proto(PrefillRequest("req-b", (1, 2), sampling))
    assert second.sampling.max_tokens == 7
    assert fields.sampling_to_proto(sampling).max_tokens == 7


def test_unset_top_p_reads_as_disabled() -> None:
    sampling = fields.sampling_from_proto(types_pb2.SamplingParams(max_tokens=3))
    assert sampling.top_p == 1.0
    assert sampling.seed is None


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (types_pb2.SamplingParams(max_tokens=0), "max_tokens"),
        (types_pb2.SamplingParams(max_tokens=1, temperature=-1), "temperature"),
        (types_pb2.SamplingParams(max_tokens=1, temperature=float("nan")), "temperature"),
        (types_pb2.SamplingParams(max_tokens=1, top_p=1.5), "top_p"),
        (types_pb2.SamplingParams(max_tokens=1, seed=2**63), "seed"),
        (types_pb2.SamplingParams(max_tokens=1, stop=["x"] * 17), "stop"),
        (types_pb2.SamplingParams(max_tokens=1, stop=[""]), "stop"),
        (types_pb2.SamplingParams(max_tokens=1, stop_token_ids=[1000]), "stop_token_ids"),
        (types_pb2.SamplingParams(max_tokens=1, stop_token_ids=[1] * 300), "stop_token_ids"),
    ],
)
def test_bad_sampling_is_invalid_naming_the_field(
    message: types_pb2.SamplingParams, field: str
) -> None:
    with pytest.raises(InvalidRequest, match=field):
        fields.sampling_from_proto(message, LIMITS)


def test_handle_round_trips() -> None:
    assert fields.handle_from_proto(fields.handle_to_proto(HANDLE), LIMITS) == HANDLE


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"producer_engine_id": ""}, "producer_engine_id"),
        ({"producer_engine_id": "a/b"}, "producer_engine_id"),
        ({"generation": 0}, "generation"),
        ({"request_id": "x" * 200}, "request_id"),
        ({"block_ids": []}, "block_ids"),
        ({"num_tokens": 0}, "num_tokens"),
        ({"lease_expires_at_s": float("inf")}, "lease_expires_at_s"),
        ({"extra": b"x" * (fields.MAX_HANDLE_EXTRA_BYTES + 1)}, "extra"),
    ],
)
def test_bad_handle_is_invalid(change: dict[str, object], field: str) -> None:
    message = fields.handle_to_proto(HANDLE)
    for key, value in change.items():
        if key == "block_ids":
            del message.block_ids[:]
        else:
            setattr(message, key, value)
    with pytest.raises(InvalidRequest, match=field):
        fields.handle_from_proto(message, LIMITS)


def test_prefill_request_round_trips_and_validates() -> None:
    sampling = SamplingParams(max_tokens=4, temperature=0.7, seed=3)
    request = PrefillRequest("cmpl-1:a", (1, 2, 3), sampling)
    message = convert.prefill_request_to_proto(request)
    assert convert.prefill_request_from_proto(message, LIMITS) == request


@pytest.mark.parametrize(
    ("request_id", "tokens", "match"),
    [
        ("", [1], "request_id"),
        ("-leading-dash", [1], "request_id"),
        ("bad id", [1], "request_id"),
        ("r", [], "token_ids"),
        ("r", [1000], "vocabulary"),
        ("r", list(range(64)), "context"),
    ],
)
def test_bad_prefill_request_is_invalid(request_id: str, tokens: list[int], match: str) -> None:
    message = prefill_pb2.PrefillRequest(request_id=request_id, token_ids=tokens)
    with pytest.raises(InvalidRequest, match=match):
        convert.prefill_request_from_proto(message, LIMITS)


def test_a_continuations_output_in_prompt_round_trips_and_is_bounded_by_the_prompt() -> None:
    continued = SamplingParams(max_tokens=4, presence_penalty=0.5, output_tokens_in_prompt=2)
    request = PrefillRequest("cmpl-1.m1", (1, 2, 3), continued)
    message = convert.prefill_request_to_proto(request)
    assert convert.prefill_request_from_proto(message, LIMITS) == request
    decode = DecodeRequest("cmpl-1.m1", (1, 2, 3), continued)
    assert convert.decode_request_from_proto(convert.decode_request_to_proto(decode), LIMITS) == (
        decode
    )
    message.sampling.output_tokens_in_prompt = 4
    with pytest.raises(InvalidRequest, match="output_tokens_in_prompt"):
        convert.prefill_request_from_proto(message, LIMITS)
    too_many = convert.decode_request_to_proto(decode)
    too_many.sampling.output_tokens_in_prompt = 4
    with pytest.raises(InvalidRequest, match="output_tokens_in_prompt"):
        convert.decode_request_from_proto(too_many, LIMITS)


def test_prefill_result_round_trips_with_and_without_handle() -> None:
    usage = Usage(prompt_tokens=5, completion_tokens=1, cached_tokens=2, cache_write_tokens=3)
    held = PrefillResult("req-1", 42, "x", HANDLE, None, usage, prefill_s=0.25, queue_s=0.5)
    done = PrefillResult("req-2", 7, "", None, FinishReason.LENGTH, usage)
    for result in (held, done):
        wire = prefill_pb2.PrefillResponse.FromString(
            convert.prefill_result_to_proto(result).SerializeToString()
        )
        assert convert.prefill_result_from_proto(wire) == result


def test_decode_request_round_trips() -> None:
    disaggregated = DecodeRequest("req-1", (1, 2, 3, 4, 5), SamplingParams(), HANDLE, 42)
    local = DecodeRequest("req-2", (9,), SamplingParams(max_tokens=2))
    for request in (disaggregated, local):
        message = convert.decode_request_to_proto(request)
        assert convert.decode_request_from_proto(message, LIMITS) == request


def test_decode_request_handle_rules() -> None:
    message = convert.decode_request_to_proto(
        DecodeRequest("req-1", (1, 2, 3, 4, 5), SamplingParams(), HANDLE, 42)
    )
    no_first = decode_pb2.DecodeRequest()
    no_first.CopyFrom(message)
    no_first.ClearField("first_token_id")
    with pytest.raises(InvalidRequest, match="first_token_id is required"):
        convert.decode_request_from_proto(no_first, LIMITS)
    wrong_len = decode_pb2.DecodeRequest()
    wrong_len.CopyFrom(message)
    wrong_len.token_ids.append(1)
    with pytest.raises(InvalidRequest, match="num_tokens"):
        convert.decode_request_from_proto(wrong_len, LIMITS)
    stray_first = decode_pb2.DecodeRequest(request_id="r", token_ids=[1], first_token_id=3)
    with pytest.raises(InvalidRequest, match="only valid with kv_handle"):
        convert.decode_request_from_proto(stray_first, LIMITS)


def test_deltas_round_trip() -> None:
    usage = Usage(prompt_tokens=3, completion_tokens=4)
    deltas = [
        TokenDelta((1, 2), "ab", kv_transfer_s=0.01),
        TokenDelta((7,), "g", cached_tokens=96),
        TokenDelta((8,), "h", cached_tokens=0),  # none found: 0, not absent
        TokenDelta((3,), "c"),
        TokenDelta((), "", FinishReason.STOP, usage),
        TokenDelta((), "", FinishReason.ERROR, usage, error="rank 1 died"),
    ]
    for delta in deltas:
        wire = decode_pb2.DecodeChunk.FromString(convert.delta_to_proto(delta).SerializeToString())
        assert convert.delta_from_proto(wire) == delta


def test_merged_deltas_keep_the_first_deltas_cached_tokens() -> None:
    """DecodeOnce merges a run's steps: a local run's cached tokens (on its first delta) and the
    last delta's usage both survive."""
    usage = Usage(prompt_tokens=100, completion_tokens=2, cached_tokens=96)
    merged = convert.merge_deltas(
        [TokenDelta((1,), "a", cached_tokens=96), TokenDelta((2,), "b", FinishReason.LENGTH, usage)]
    )
    assert (merged.cached_tokens, merged.usage, merged.token_ids) == (96, usage, (1, 2))


def test_unknown_finish_reason_reads_as_error() -> None:
    chunk = decode_pb2.DecodeChunk()
    chunk.ParseFromString(b"\x18\x09")  # field 3 (finish_reason) = 9, a future enum value
    assert convert.delta_from_proto(chunk).finish_reason is FinishReason.ERROR
