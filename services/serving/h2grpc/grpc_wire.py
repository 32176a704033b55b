"""gRPC's wire pieces on HTTP/2 (gRPC's PROTOCOL-HTTP2), as bytes and tables.

A request's header fields (``content-type: application/grpc``, ``te: trailers``,
``grpc-timeout``, a call's custom metadata), the length-prefixed message, and what a response's
HTTP/2 outcome (a ``:status``, a RST_STREAM's error code) and its ``grpc-status`` and
``grpc-message`` mean as a gRPC status. No state: :mod:`~services.serving.h2grpc.protocol` (the
calls) uses them.

Below: :mod:`~services.serving.h2grpc.frames` (HPACK literals, the request's pseudo-headers,
HTTP/2's error codes). Above: :mod:`~services.serving.h2grpc.protocol` and the channel (which
checks a call's metadata with :func:`metadata_block` before it starts).
"""

from __future__ import annotations

import base64
import math
import re
import struct
from collections.abc import Sequence
from urllib.parse import unquote

import grpc

from services.serving.h2grpc import frames
from services.serving.h2grpc.frames import ErrorCode, literal

MESSAGE_PREFIX_BYTES = 5
"""A message's prefix: a compressed flag (1 byte) and its length (4 bytes, big-endian)."""


def request_headers_prefix(path: bytes, authority: bytes, *, tls: bool) -> bytes:
    """A request's header block without its ``grpc-timeout`` (which :func:`timeout_field`
    appends): the same bytes for every call of one method on one connection."""
    return b"".join(
        (
            frames.post_request(path, authority, tls=tls),
            literal(frames.STATIC_CONTENT_TYPE, b"application/grpc"),
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


_TIMEOUT_NAME = b"\x00" + frames.hpack_string(b"grpc-timeout")
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
