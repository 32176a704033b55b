"""A request's LoRA adapter on the wire (issue 48): it round-trips on Prefill and Decode, an
engine without LoRA slots refuses it naming its kind (the reference engine), and a malformed
one is refused before any backend sees it."""

from __future__ import annotations

import pytest

from services.engines.errors import InvalidRequest, LoRANotServed
from services.engines.lora import MAX_LORA_NAME_CHARS, LoRAAdapter
from services.engines.requests import (
    DecodeRequest,
    PrefillRequest,
    RequestLimits,
    SamplingParams,
)
from services.proto_gen.pdserve.v1 import prefill_pb2, types_pb2
from services.serving.wire import convert

SQL = LoRAAdapter("sql", "/adapters/sql")
WITH_SLOTS = RequestLimits(vocab_size=1000, max_model_len=64, lora_slots=2, engine_kind="vllm")
NO_SLOTS = RequestLimits(vocab_size=1000, max_model_len=64, engine_kind="reference")


def test_the_adapter_round_trips_on_prefill_and_decode() -> None:
    prefill = PrefillRequest("r1", (1, 2, 3), SamplingParams(max_tokens=4), lora=SQL)
    assert (
        convert.prefill_request_from_proto(convert.prefill_request_to_proto(prefill), WITH_SLOTS)
        == prefill
    )
    decode = DecodeRequest("r2", (1, 2, 3), SamplingParams(max_tokens=4), lora=SQL)
    assert (
        convert.decode_request_from_proto(convert.decode_request_to_proto(decode), WITH_SLOTS)
        == decode
    )
    base = PrefillRequest("r3", (1, 2, 3), SamplingParams(max_tokens=4))
    message = convert.prefill_request_to_proto(base)
    assert not message.HasField("lora")
    assert convert.prefill_request_from_proto(message, NO_SLOTS).lora is None


def test_an_engine_without_lora_slots_refuses_an_adapter_naming_its_kind() -> None:
    message = convert.prefill_request_to_proto(PrefillRequest("r1", (1, 2), lora=SQL))
    with pytest.raises(LoRANotServed, match="this reference engine serves no LoRA adapter"):
        convert.prefill_request_from_proto(message, NO_SLOTS)


@pytest.mark.parametrize(
    ("name", "path", "match"),
    [
        ("", "/a", "name must be"),
        ("x" * (MAX_LORA_NAME_CHARS + 1), "/a", "name must be"),
        ("sql", "", "path must be"),
        ("sql", "/a\0b", "NUL"),
    ],
)
def test_a_malformed_adapter_is_invalid(name: str, path: str, match: str) -> None:
    message = prefill_pb2.PrefillRequest(
        request_id="r1", token_ids=[1], lora=types_pb2.LoRAAdapter(name=name, path=path)
    )
    with pytest.raises(InvalidRequest, match=match):
        convert.prefill_request_from_proto(message, WITH_SLOTS)
