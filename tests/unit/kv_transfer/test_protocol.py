"""The completion notification's wire format: round trip and hostile input."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.kv_transfer.errors import NotificationDecodeError
from services.kv_transfer.protocol import (
    NOTIFICATION_VERSION,
    KVNotification,
    decode_notification,
    encode_notification,
    rank_label,
)

notifications = st.builds(
    KVNotification,
    request_id=st.text(min_size=1, max_size=64),
    consumer_engine=st.text(min_size=1, max_size=64),
    consumer_generation=st.integers(0, 2**40),
    consumer_rank=st.tuples(st.integers(0, 64), st.integers(0, 64)),
    expected_notifiers=st.integers(1, 64),
    ok=st.booleans(),
)


@given(notifications)
def test_round_trip(notification: KVNotification):
    assert decode_notification(encode_notification(notification)) == notification


@settings(max_examples=300)
@given(st.binary(max_size=2048))
def test_arbitrary_bytes_raise_only_the_decode_error(data: bytes):
    with contextlib.suppress(NotificationDecodeError):
        decode_notification(data)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ([NOTIFICATION_VERSION + 1, "r", "e", 1, 0, 0, 1, True], "version"),
        ([NOTIFICATION_VERSION, "r", "e", 1, 0, 0, 1], "fields"),
        ([NOTIFICATION_VERSION, "", "e", 1, 0, 0, 1, True], "request_id"),
        ([NOTIFICATION_VERSION, "r", "e", 1, -1, 0, 1, True], "pp_rank"),
        ([NOTIFICATION_VERSION, "r", "e", 1, 0, 0, 0, True], "expected_notifiers"),
        ([NOTIFICATION_VERSION, "r", "e", True, 0, 0, 1, True], "consumer_generation"),
        ([NOTIFICATION_VERSION, "r", "e", 1, 0, 0, 1, 1], "ok"),
        ("a string", "versioned list"),
        ({"v": 1}, "max_map_len"),
    ],
)
def test_malformed_fields_are_named(body: object, match: str):
    with pytest.raises(NotificationDecodeError, match=match):
        decode_notification(msgpack.packb(body))


def test_oversized_is_refused_before_unpacking():
    with pytest.raises(NotificationDecodeError, match="oversized"):
        decode_notification(b"\x91" + b"a" * 4096)


def test_rank_label():
    assert rank_label((0, 1)) == "pp0tp1"
