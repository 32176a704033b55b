"""HTTP/2 frames and HPACK's literal fields, as bytes (RFC 9113, RFC 7541).

Only what pdserve's client sends or must understand: frame headers, SETTINGS, PING,
WINDOW_UPDATE, RST_STREAM, GOAWAY, DATA and HEADERS, and a request's pseudo-header fields. Header
blocks are encoded here without HPACK's dynamic table (literal fields, never indexed, never
Huffman), so the connection's encoder keeps no state; responses are decoded by
:mod:`~services.serving.h2grpc.hpack_decoder`, which follows the server's dynamic table.

Below: nothing (bytes). Above: :mod:`~services.serving.h2grpc.http2` (the connection) and
:mod:`~services.serving.h2grpc.grpc_wire` (gRPC's fields and message prefix, written with
:func:`literal`). Nothing of gRPC is here: no ``grpc-`` field, no message prefix, no status.
"""

from __future__ import annotations

import enum
import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_BYTES = 9
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MAX_HEADER_LIST_SIZE = 64 << 10
"""The SETTINGS_MAX_HEADER_LIST_SIZE the client advertises and enforces on a response's header
block (HEADERS and its CONTINUATIONs: their encoded bytes while they gather, then the decoded
list as RFC 9113 counts it, each field's name and value plus 32). gRPC's own clients refuse
metadata over 16 KiB (grpc-core's hard limit, 8 KiB soft); pdserve's engines send a few hundred
bytes (a status, its message, one or two metadata entries). 64 KiB is four times gRPC's bound, so
no answer a gRPC client would take is refused, while one engine can make the router hold at most
this much of a header block per connection."""


class FrameType:
    """Frame types (plain ints: compared per frame on the hot path, where enums cost)."""

    DATA = 0x0
    HEADERS = 0x1
    PRIORITY = 0x2
    RST_STREAM = 0x3
    SETTINGS = 0x4
    PUSH_PROMISE = 0x5
    PING = 0x6
    GOAWAY = 0x7
    WINDOW_UPDATE = 0x8
    CONTINUATION = 0x9


class Flag:
    """Frame flags (plain ints, see :class:`FrameType`)."""

    END_STREAM = 0x1
    ACK = 0x1
    END_HEADERS = 0x4
    PADDED = 0x8
    PRIORITY = 0x20


class Setting:
    """SETTINGS identifiers."""

    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6


class ErrorCode(enum.IntEnum):
    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


_HEADER = struct.Struct(">HBBBL")
"""A frame header as (length high 16 bits, length low 8 bits, type, flags, stream id)."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return _HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


def parse_frame_header(
    data: bytes | bytearray | memoryview, offset: int
) -> tuple[int, int, int, int]:
    """``(length, type, flags, stream id)`` of the frame header at ``offset``."""
    high, low, kind, flags, stream_id = _HEADER.unpack_from(data, offset)
    return (high << 8) | low, kind, flags, stream_id & MAX_WINDOW


def settings(values: dict[int, int]) -> bytes:
    payload = b"".join(struct.pack(">HL", key, value) for key, value in values.items())
    return frame(FrameType.SETTINGS, 0, 0, payload)


SETTINGS_ACK = frame(FrameType.SETTINGS, Flag.ACK, 0)


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(FrameType.WINDOW_UPDATE, 0, stream_id, struct.pack(">L", increment))


def rst_stream(stream_id: int, code: ErrorCode) -> bytes:
    return frame(FrameType.RST_STREAM, 0, stream_id, struct.pack(">L", code))


def ping(payload: bytes, *, ack: bool = False) -> bytes:
    return frame(FrameType.PING, Flag.ACK if ack else 0, 0, payload)


def goaway(last_stream_id: int, code: ErrorCode, debug: bytes = b"") -> bytes:
    return frame(FrameType.GOAWAY, 0, 0, struct.pack(">LL", last_stream_id, code) + debug)


# -- HPACK: literal request fields, no dynamic table -------------------------------------------


def hpack_int(value: int, prefix_bits: int, first_byte_flags: int = 0) -> bytes:
    """RFC 7541 5.1: ``value`` on a ``prefix_bits``-bit prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first_byte_flags | value])
    out = bytearray([first_byte_flags | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def hpack_string(value: bytes) -> bytes:
    return hpack_int(len(value), 7) + value


def literal(name: bytes | int, value: bytes) -> bytes:
    """A field "literal without indexing": ``name`` a static-table index or a new name."""
    if isinstance(name, int):
        return hpack_int(name, 4) + hpack_string(value)
    return b"\x00" + hpack_string(name) + hpack_string(value)


_STATIC_METHOD_POST = b"\x83"
_STATIC_SCHEME = {False: b"\x86", True: b"\x87"}  # :scheme http / https
_STATIC_AUTHORITY = 1
_STATIC_PATH = 4
STATIC_CONTENT_TYPE = 31
"""HPACK's static-table index of the name ``content-type`` (RFC 7541 Appendix A)."""
TABLE_SIZE_ZERO = b"\x20"
"""A dynamic table size update to 0 (the first block of a connection): this encoder never
indexes, so the server's decoder need keep nothing for it."""


def post_request(path: bytes, authority: bytes, *, tls: bool) -> bytes:
    """A POST request's pseudo-header fields (``:method``, ``:scheme``, ``:path``,
    ``:authority``), the start of its header block."""
    return b"".join(
        (
            _STATIC_METHOD_POST,
            _STATIC_SCHEME[tls],
            literal(_STATIC_PATH, path),
            literal(_STATIC_AUTHORITY, authority),
        )
    )
