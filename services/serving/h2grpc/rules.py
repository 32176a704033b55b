"""What a received frame must be (RFC 9113 §4-§6), checked before the connection acts on it.

Each check raises :class:`~services.serving.h2grpc.errors.ProtocolError`: a connection error
(``stream_id`` 0) or a stream error, with the error code RFC 9113 names for the breach. No state
here: the connection passes in what a check needs (its windows, the bounds it advertised), so
every rule is a unit test (tests/unit/serving/test_h2grpc_rules.py).
"""

from __future__ import annotations

import struct

from services.serving.h2grpc import frames
from services.serving.h2grpc.errors import ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode, Flag, FrameType, Setting

_NAMES = {
    value: name
    for name, value in vars(FrameType).items()
    if not name.startswith("_") and isinstance(value, int)
}
_FIXED_LENGTH = {
    FrameType.RST_STREAM: 4,
    FrameType.PING: 8,
    FrameType.WINDOW_UPDATE: 4,
    FrameType.PRIORITY: 5,
}
_CONNECTION_FRAMES = (FrameType.SETTINGS, FrameType.PING, FrameType.GOAWAY)
_STREAM_FRAMES = (
    FrameType.DATA,
    FrameType.HEADERS,
    FrameType.PRIORITY,
    FrameType.RST_STREAM,
    FrameType.PUSH_PROMISE,
    FrameType.CONTINUATION,
)
MAX_FRAME_SIZE_LIMIT = 2**24 - 1


def _malformed(message: str, *, stream_id: int = 0) -> ProtocolError:
    return ProtocolError(
        Violation.MALFORMED, ErrorCode.PROTOCOL_ERROR, message, stream_id=stream_id
    )


def check_frame_header(length: int, kind: int, flags: int, stream_id: int, max_frame: int) -> None:
    """A frame header before its payload is read: its length against ``max_frame`` (what the
    client advertised) and the frame's fixed size, its stream id against its type. The
    connection calls it for every frame but DATA and HEADERS of a stream within the bound."""
    name = _NAMES.get(kind)
    if length > max_frame:
        raise ProtocolError(
            Violation.FRAME_SIZE,
            ErrorCode.FRAME_SIZE_ERROR,
            f"sent a {name or f'type {kind}'} frame of {length} bytes, over the "
            f"{max_frame} advertised (SETTINGS_MAX_FRAME_SIZE)",
        )
    if name is None:
        return  # an unknown frame type is ignored (RFC 9113 §4.1)
    if stream_id and kind in _CONNECTION_FRAMES:
        raise _malformed(f"sent a {name} frame on stream {stream_id}")
    if not stream_id and kind in _STREAM_FRAMES:
        raise _malformed(f"sent a {name} frame on stream 0")
    fixed = _FIXED_LENGTH.get(kind)
    wrong = (
        (fixed is not None and length != fixed)
        or (kind == FrameType.GOAWAY and length < 8)
        or (kind == FrameType.SETTINGS and (length % 6 or (flags & Flag.ACK and length)))
    )
    if wrong:
        expected = (
            f"{fixed}"
            if fixed is not None
            else "at least 8"
            if kind == FrameType.GOAWAY
            else "0 (an ACK)"
            if flags & Flag.ACK
            else "a multiple of 6"
        )
        # All connection errors: PRIORITY's could be a stream error (§6.3), but a peer that
        # gets a fixed size wrong is not worth keeping (§5.4 allows the stronger answer).
        raise ProtocolError(
            Violation.FRAME_SIZE,
            ErrorCode.FRAME_SIZE_ERROR,
            f"sent a {name} frame of {length} bytes (expected {expected})",
        )


def unpadded(kind: int, flags: int, payload: bytes) -> tuple[int, int]:
    """``(start, end)`` of a DATA or HEADERS frame's content: without its padding and (HEADERS)
    its priority fields."""
    start, end = 0, len(payload)
    if flags & Flag.PADDED:
        if not end:
            raise _malformed(f"sent a padded {_NAMES[kind]} frame without its pad length")
        start, end = 1, end - payload[0]
    if kind == FrameType.HEADERS and flags & Flag.PRIORITY:
        start += 5
    if end < start:
        raise _malformed(f"sent a {_NAMES[kind]} frame whose padding exceeds its payload")
    return start, end


def window_increment(stream_id: int, payload: bytes, window: int) -> int:
    """A WINDOW_UPDATE's increment, checked: not 0, and ``window`` (the one it opens) stays
    within 2^31-1 (a stream error when ``stream_id`` is a stream's)."""
    increment: int = struct.unpack(">L", payload)[0] & frames.MAX_WINDOW
    where = f"stream {stream_id}" if stream_id else "the connection"
    if not increment:
        raise ProtocolError(
            Violation.WINDOW_UPDATE_ZERO,
            ErrorCode.PROTOCOL_ERROR,
            f"sent a WINDOW_UPDATE of 0 on {where}",
            stream_id=stream_id,
        )
    if window + increment > frames.MAX_WINDOW:
        raise ProtocolError(
            Violation.WINDOW_OVERFLOW,
            ErrorCode.FLOW_CONTROL_ERROR,
            f"sent a WINDOW_UPDATE of {increment} on {where}, taking its window of {window} "
            f"past 2^31-1",
            stream_id=stream_id,
        )
    return increment


def settings(payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS frame's ``(identifier, value)`` pairs, their values checked (§6.5.2)."""
    values = [struct.unpack_from(">HL", payload, offset) for offset in range(0, len(payload), 6)]
    for key, value in values:
        if key == Setting.ENABLE_PUSH and value != 0:
            raise _malformed(f"sent SETTINGS_ENABLE_PUSH {value} to a client")
        if key == Setting.INITIAL_WINDOW_SIZE and value > frames.MAX_WINDOW:
            raise ProtocolError(
                Violation.WINDOW_OVERFLOW,
                ErrorCode.FLOW_CONTROL_ERROR,
                f"sent SETTINGS_INITIAL_WINDOW_SIZE {value}, over 2^31-1",
            )
        if key == Setting.MAX_FRAME_SIZE and not (
            frames.DEFAULT_MAX_FRAME <= value <= MAX_FRAME_SIZE_LIMIT
        ):
            raise _malformed(f"sent SETTINGS_MAX_FRAME_SIZE {value}, outside 2^14..2^24-1")
    return values


def goaway(payload: bytes) -> tuple[int, int]:
    """A GOAWAY's last stream id and error code (its debug data ignored)."""
    last_stream_id, error = struct.unpack_from(">LL", payload)
    return last_stream_id & frames.MAX_WINDOW, error


def error_name(code: int) -> str:
    """An HTTP/2 error code as RFC 9113 names it (``REFUSED_STREAM``), or its number."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"error {code}"
