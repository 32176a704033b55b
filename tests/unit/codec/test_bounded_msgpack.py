"""The one bounded msgpack decode: every limit holds, every msgpack failure is one error."""

from __future__ import annotations

import msgpack
import pytest

from services.codec import MsgpackBounds, UnpackError, unpack_bounded
from services.engines.vllm.handshake import HandshakeResolutionError, VllmHandshakeExtra

BOUNDS = MsgpackBounds(max_bytes=256, max_str_len=8, max_bin_len=4, max_array_len=3, max_map_len=2)


def test_a_value_within_every_bound_decodes() -> None:
    value = {"a": [1, b"xy", "short"], "b": None}
    assert unpack_bounded(msgpack.packb(value, use_bin_type=True), BOUNDS) == value


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("s" * 9, "malformed"),  # string past max_str_len
        (b"b" * 5, "malformed"),  # binary past max_bin_len
        ([1, 2, 3, 4], "malformed"),  # array past max_array_len
        ({"a": 1, "b": 2, "c": 3}, "malformed"),  # map past max_map_len
        ({1: "int key"}, "malformed"),  # strict map keys
    ],
)
def test_each_bound_is_refused_as_malformed(value: object, reason: str) -> None:
    with pytest.raises(UnpackError) as refused:
        unpack_bounded(msgpack.packb(value, use_bin_type=True), BOUNDS)
    assert refused.value.reason == reason


@pytest.mark.parametrize(
    "data",
    [
        b"\xc1",  # a format byte msgpack never uses
        b"\x92\x01",  # truncated array
        msgpack.packb(1) + msgpack.packb(2),  # trailing data
        b"\xa2\xff\xfe",  # a str that is not UTF-8
        b"\xc7\x01\x05x",  # an extension type
        b"\x91" * 2000 + b"\x01",  # nested past msgpack's stack (StackError)
    ],
)
def test_every_msgpack_failure_is_one_error(data: bytes) -> None:
    bounds = MsgpackBounds(
        max_bytes=4096, max_str_len=64, max_bin_len=64, max_array_len=8, max_map_len=8
    )
    with pytest.raises(UnpackError) as refused:
        unpack_bounded(data, bounds)
    assert refused.value.reason == "malformed"


def test_an_oversized_buffer_is_refused_unread() -> None:
    with pytest.raises(UnpackError) as refused:
        unpack_bounded(b"\x00" * 257, BOUNDS)
    assert refused.value.reason == "oversized"


@pytest.mark.parametrize("data", [b"\x91" * 2000 + b"\x01", b"\x80" * (3 << 20), b"\xc1"])
def test_vllm_handshake_extra_refuses_hostile_bytes_with_its_own_error(data: bytes) -> None:
    """Redis is a trust boundary: what the one decode refuses is a resolution error."""
    with pytest.raises(HandshakeResolutionError):
        VllmHandshakeExtra.decode(data)
