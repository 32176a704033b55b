"""HTTP/2 frames and gRPC's wire pieces, as bytes (RFC 9113, RFC 7541, gRPC's PROTOCOL-HTTP2).

Only what a gRPC client of pdserve's engines sends or must understand: frame headers, SETTINGS,
PING, WINDOW_UPDATE, RST_STREAM, GOAWAY, request HEADERS (a call's metadata included), the
length-prefixed message, the ``grpc-timeout`` header and the status a response's HTTP/2 outcome
maps to. Request header blocks are encoded here without HPACK's dynamic table (literal fields,
never indexed, never Huffman), so the connection's encoder keeps no state; responses are decoded
with the ``hpack`` package, whose decoder follows the server's dynamic table.
"""

from __future__ import annotations

import base64
import enum
import math
import re
import struct
from collections.abc import Sequence
from urllib.parse import unquote

import grpc

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_HEADER_BYTES = 9
DEFAULT_WINDOW = 65_535
DEFAULT_MAX_FRAME = 16_384
MAX_WINDOW = 2**31 - 1
MESSAGE_PREFIX_BYTES = 5
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
_STATIC_CONTENT_TYPE = 31
TABLE_SIZE_ZERO = b"\x20"
"""A dynamic table size update to 0 (the first block of a connection): this encoder never
indexes, so the server's decoder need keep nothing for it."""


def request_headers_prefix(path: bytes, authority: bytes, *, tls: bool) -> bytes:
    """A request's header block without its ``grpc-timeout`` (which :func:`timeout_field`
    appends): the same bytes for every call of one method on one connection."""
    return b"".join(
        (
            _STATIC_METHOD_POST,
            _STATIC_SCHEME[tls],
            literal(_STATIC_PATH, path),
            literal(_STATIC_AUTHORITY, authority),
            literal(_STATIC_CONTENT_TYPE, b"application/grpc"),
            literal(b"te", b"trailers"),
            # Said outright: this client decompresses nothing (a compressed message fails its
            # call INTERNAL, naming the encoding the server chose).
            literal(b"grpc-accept-encoding", b"identity"),
            literal(b"user-agent", b"pdserve-h2grpc"),
        )
    )


_TIMEOUT_UNITS_NS = (
    (1, b"n"),
    (1_000, b"u"),
    (1_000_000, b"m"),
    (1_000_000_000, b"S"),
    (60_000_000_000, b"M"),
    (3_600_000_000_000, b"H"),
)


_TIMEOUT_NAME = b"\x00" + hpack_string(b"grpc-timeout")
"""A ``grpc-timeout`` literal's first part (its value, at most 9 bytes, follows its length)."""


def timeout_field(timeout_s: float) -> bytes:
    """The ``grpc-timeout`` field for ``timeout_s`` (at most 8 digits, the finest unit that fits,
    rounded up so the server never ends the call before the client's own deadline): the same
    bytes as ``literal(b"grpc-timeout", value)``, the name encoded once."""
    nanoseconds = max(math.ceil(timeout_s * 1e9), 1)
    value = b"99999999H"
    for unit_ns, unit in _TIMEOUT_UNITS_NS:
        count = -(-nanoseconds // unit_ns)
        if count < 100_000_000:
            value = b"%d%s" % (count, unit)
            break
    return _TIMEOUT_NAME + bytes((len(value),)) + value


MAX_METADATA_BYTES = 8 << 10
"""The most a call's custom metadata may take, encoded: gRPC's soft limit on a header list
(8 KiB, grpc-core's default). It also keeps a request's header block within one HEADERS frame
(16 KiB, the least SETTINGS_MAX_FRAME_SIZE a server may have), which this client relies on."""
_METADATA_NAME = re.compile(r"[0-9a-z_.\-]+")
_METADATA_VALUE = re.compile(r"[\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?|")
_RESERVED_NAMES = frozenset(
    {"content-type", "te", "user-agent", "host", "connection", "keep-alive", "proxy-connection"}
    | {"transfer-encoding", "upgrade"}
)
"""Names a call's metadata may not use: the fields this client writes itself and those HTTP/2
forbids (RFC 9113 8.2.2); ``grpc-`` names are gRPC's own and ``:`` names are pseudo-headers."""


def metadata_block(metadata: Sequence[tuple[str, str | bytes]]) -> bytes:
    """A call's custom metadata as header fields (gRPC's PROTOCOL-HTTP2 ``Custom-Metadata``),
    each a literal without indexing with a new name (RFC 7541 6.2.2).

    A name is lowercase ASCII (``0-9 a-z _ - .``), neither reserved (``:``-prefixed, ``grpc-``,
    or one of :data:`_RESERVED_NAMES`); a ``-bin`` name takes ``bytes``, sent as base64 without
    padding, any other a ``str`` of printable ASCII that neither starts nor ends with a space.
    Raises :class:`ValueError` naming the first pair that breaks a rule, and when the block
    would pass :data:`MAX_METADATA_BYTES`."""
    parts: list[bytes] = []
    for name, value in metadata:
        if not _METADATA_NAME.fullmatch(name) or name.startswith("grpc-"):
            raise ValueError(f"metadata name {name!r} is not a custom gRPC metadata name")
        if name in _RESERVED_NAMES:
            raise ValueError(f"metadata name {name!r} is reserved")
        if name.endswith("-bin"):
            if not isinstance(value, bytes):
                raise ValueError(f"metadata {name!r} is binary (-bin): its value must be bytes")
            encoded = base64.b64encode(value).rstrip(b"=")
        elif not isinstance(value, str) or not _METADATA_VALUE.fullmatch(value):
            raise ValueError(
                f"metadata {name!r}: {value!r} is not printable ASCII without outer spaces"
            )
        else:
            encoded = value.encode("ascii")
        parts.append(literal(name.encode("ascii"), encoded))
    block = b"".join(parts)
    if len(block) > MAX_METADATA_BYTES:
        raise ValueError(f"metadata of {len(block)} bytes is over {MAX_METADATA_BYTES}")
    return block


def message(payload: bytes) -> bytes:
    """gRPC's length-prefixed message: not compressed, 4-byte big-endian length."""
    return struct.pack(">BL", 0, len(payload)) + payload


# -- What an HTTP/2 outcome means as a gRPC status ----------------------------------------------

_HTTP_STATUS_CODE = {
    400: grpc.StatusCode.INTERNAL,
    401: grpc.StatusCode.UNAUTHENTICATED,
    403: grpc.StatusCode.PERMISSION_DENIED,
    404: grpc.StatusCode.UNIMPLEMENTED,
    429: grpc.StatusCode.UNAVAILABLE,
    502: grpc.StatusCode.UNAVAILABLE,
    503: grpc.StatusCode.UNAVAILABLE,
    504: grpc.StatusCode.UNAVAILABLE,
}
_RST_CODE: dict[int, grpc.StatusCode] = {
    ErrorCode.NO_ERROR: grpc.StatusCode.INTERNAL,
    ErrorCode.REFUSED_STREAM: grpc.StatusCode.UNAVAILABLE,
    ErrorCode.CANCEL: grpc.StatusCode.CANCELLED,
    ErrorCode.ENHANCE_YOUR_CALM: grpc.StatusCode.RESOURCE_EXHAUSTED,
    ErrorCode.INADEQUATE_SECURITY: grpc.StatusCode.PERMISSION_DENIED,
}
STATUS_BY_NUMBER = {code.value[0]: code for code in grpc.StatusCode}


def status_of_http(status: int) -> grpc.StatusCode:
    """gRPC's mapping of a non-200 ``:status`` (the response did not come from a gRPC server)."""
    return _HTTP_STATUS_CODE.get(status, grpc.StatusCode.UNKNOWN)


def status_of_reset(code: int) -> grpc.StatusCode:
    """gRPC's mapping of a RST_STREAM error code that came before the trailers."""
    return _RST_CODE.get(code, grpc.StatusCode.INTERNAL)


def grpc_message(value: str) -> str:
    """``grpc-message`` is percent-encoded UTF-8."""
    return unquote(value, errors="replace")
