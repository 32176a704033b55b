"""What h2grpc takes from a server (``rules``, the decoder's header-list bound): each breach
is the error RFC 9113 names, a connection or a stream error as it says."""

from __future__ import annotations

import struct

import hpack
import pytest

from services.serving.h2grpc import rules
from services.serving.h2grpc.errors import ProtocolError, Violation
from services.serving.h2grpc.frames import (
    DEFAULT_MAX_FRAME,
    MAX_WINDOW,
    ErrorCode,
    Flag,
    FrameType,
    Setting,
)
from services.serving.h2grpc.hpack_decoder import HeaderListTooLarge, HpackDecoder


@pytest.mark.parametrize(
    ("length", "kind", "flags", "stream_id", "code", "violation"),
    [
        (DEFAULT_MAX_FRAME + 1, FrameType.DATA, 0, 1, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (3, FrameType.RST_STREAM, 0, 1, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (7, FrameType.PING, 0, 0, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (5, FrameType.WINDOW_UPDATE, 0, 0, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (4, FrameType.GOAWAY, 0, 0, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (7, FrameType.SETTINGS, 0, 0, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (6, FrameType.SETTINGS, Flag.ACK, 0, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (4, FrameType.PRIORITY, 0, 1, ErrorCode.FRAME_SIZE_ERROR, "frame_size"),
        (0, FrameType.SETTINGS, 0, 1, ErrorCode.PROTOCOL_ERROR, "malformed"),
        (8, FrameType.PING, 0, 3, ErrorCode.PROTOCOL_ERROR, "malformed"),
        (8, FrameType.DATA, 0, 0, ErrorCode.PROTOCOL_ERROR, "malformed"),
        (4, FrameType.RST_STREAM, 0, 0, ErrorCode.PROTOCOL_ERROR, "malformed"),
    ],
)
def test_a_frame_header_breach_is_a_connection_error(
    length: int, kind: int, flags: int, stream_id: int, code: ErrorCode, violation: str
) -> None:
    with pytest.raises(ProtocolError) as error:
        rules.check_frame_header(length, kind, flags, stream_id, DEFAULT_MAX_FRAME)
    assert (error.value.code, error.value.violation, error.value.stream_id) == (code, violation, 0)


@pytest.mark.parametrize(
    ("length", "kind", "flags", "stream_id"),
    [
        (DEFAULT_MAX_FRAME, FrameType.DATA, 0, 1),
        (4, FrameType.WINDOW_UPDATE, 0, 0),
        (4, FrameType.WINDOW_UPDATE, 0, 1),
        (8, FrameType.GOAWAY, 0, 0),
        (20, FrameType.GOAWAY, 0, 0),
        (12, FrameType.SETTINGS, 0, 0),
        (0, FrameType.SETTINGS, Flag.ACK, 0),
        (100, 0x42, 0, 0),  # an unknown type is ignored
    ],
)
def test_conforming_frame_headers_pass(length: int, kind: int, flags: int, stream_id: int) -> None:
    rules.check_frame_header(length, kind, flags, stream_id, DEFAULT_MAX_FRAME)


def test_window_updates_of_zero_or_past_the_maximum_are_refused_where_they_came() -> None:
    zero, big = struct.pack(">L", 0), struct.pack(">L", MAX_WINDOW)
    with pytest.raises(ProtocolError) as on_connection:
        rules.window_increment(0, zero, 100)
    assert (on_connection.value.code, on_connection.value.stream_id) == (
        ErrorCode.PROTOCOL_ERROR,
        0,
    )
    with pytest.raises(ProtocolError) as on_stream:
        rules.window_increment(5, zero, 100)
    assert (on_stream.value.code, on_stream.value.stream_id) == (ErrorCode.PROTOCOL_ERROR, 5)
    with pytest.raises(ProtocolError) as overflow:
        rules.window_increment(5, big, 1)
    assert (overflow.value.code, overflow.value.violation, overflow.value.stream_id) == (
        ErrorCode.FLOW_CONTROL_ERROR,
        Violation.WINDOW_OVERFLOW,
        5,
    )
    assert rules.window_increment(0, big, 0) == MAX_WINDOW  # up to the maximum exactly
    assert rules.window_increment(0, struct.pack(">L", 2**31 + 7), 0) == 7  # reserved bit


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        (Setting.ENABLE_PUSH, 1, ErrorCode.PROTOCOL_ERROR),
        (Setting.INITIAL_WINDOW_SIZE, 2**31, ErrorCode.FLOW_CONTROL_ERROR),
        (Setting.MAX_FRAME_SIZE, DEFAULT_MAX_FRAME - 1, ErrorCode.PROTOCOL_ERROR),
        (Setting.MAX_FRAME_SIZE, 2**24, ErrorCode.PROTOCOL_ERROR),
    ],
)
def test_settings_out_of_range_are_connection_errors(key: int, value: int, code: int) -> None:
    with pytest.raises(ProtocolError) as error:
        rules.settings(struct.pack(">HL", key, value))
    assert error.value.code == code


def test_padding_past_the_payload_is_a_protocol_error() -> None:
    assert rules.unpadded(FrameType.DATA, Flag.PADDED, b"\x02abcd\x00\x00") == (1, 5)
    assert rules.unpadded(FrameType.HEADERS, Flag.PRIORITY, b"\x00" * 5 + b"ab") == (5, 7)
    for kind, flags, payload in (
        (FrameType.DATA, Flag.PADDED, b"\x05ab"),
        (FrameType.DATA, Flag.PADDED, b""),
        (FrameType.HEADERS, Flag.PRIORITY, b"\x00" * 4),
        (FrameType.HEADERS, Flag.PADDED | Flag.PRIORITY, b"\x02" + b"\x00" * 5),
    ):
        with pytest.raises(ProtocolError) as error:
            rules.unpadded(kind, flags, payload)
        assert error.value.code == ErrorCode.PROTOCOL_ERROR


def test_a_header_list_over_the_bound_is_refused_after_the_table_followed_it() -> None:
    encoder, decoder = hpack.Encoder(), HpackDecoder(max_list_size=10_000)
    # A small block (one field indexed, then named by its index) for a large list.
    big = encoder.encode([("x-big", "v" * 1000)] * 12)
    assert len(big) < 1_000
    with pytest.raises(HeaderListTooLarge) as error:
        decoder.decode(big)
    assert error.value.size == 12 * (5 + 1000 + 32)
    # The table has the field: the next block, which names it by index, decodes.
    assert decoder.decode(encoder.encode([("x-big", "v" * 1000)])) == (("x-big", "v" * 1000),)
    with pytest.raises(HeaderListTooLarge):
        decoder.decode(big)  # never cached
