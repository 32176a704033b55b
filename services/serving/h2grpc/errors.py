"""The errors of :mod:`services.serving.h2grpc`::

    CallFailed          a call ended with a non-OK gRPC status (from the server, or the
                        transport's outcome mapped as gRPC does: UNAVAILABLE for a refused or
                        lost connection, DEADLINE_EXCEEDED for the call's own deadline,
                        CANCELLED, RESOURCE_EXHAUSTED for a message over the bound...)
    └── NotStarted      internal to the channel: UNAVAILABLE before anything of the call
                        was sent (its connection went away while it waited for a stream)
    ProtocolError       internal: the server broke HTTP/2 or gRPC's framing (RFC 9113 §5.4).
                        Never leaves the package: the connection turns it into a GOAWAY
                        (connection error) or a RST_STREAM (stream error) and its calls'
                        CallFailed, and counts it (:class:`Violation`).

Callers translate CallFailed with :func:`services.serving.wire.status.error_from_status`, as they do
``grpc.aio.AioRpcError``: the same code, details and trailing metadata.
"""

from __future__ import annotations

import grpc

from services.serving.h2grpc.frames import ErrorCode

Metadata = tuple[tuple[str, str | bytes], ...]


class CallFailed(Exception):
    """A call's non-OK status: ``code``, ``details`` and the trailing ``metadata``."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.metadata = metadata


class NotStarted(CallFailed):
    """UNAVAILABLE before anything of the call was sent: its connection stopped taking calls
    (a GOAWAY, set aside, closed) while the call waited for a stream there. It may start on
    another connection."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details)


class Violation:
    """What a server did wrong: the label a :class:`ProtocolError` is counted under (the
    channel's ``on_protocol_error`` callback), a small fixed set."""

    FRAME_SIZE = "frame_size"
    """A frame over the client's SETTINGS_MAX_FRAME_SIZE, or one of a fixed size that is not."""
    MALFORMED = "malformed"
    """A frame on the wrong stream, padding past its payload, a setting out of range, an
    interrupted header block, a PUSH_PROMISE, a ``:status`` or ``grpc-status`` that is not a
    number..."""
    WINDOW_UPDATE_ZERO = "window_update_zero"
    FLOW_CONTROL = "flow_control"
    """DATA past the window the client opened (the connection's or a stream's)."""
    WINDOW_OVERFLOW = "window_overflow"
    """A WINDOW_UPDATE or an INITIAL_WINDOW_SIZE that takes a window past 2^31-1."""
    HEADER_LIST_SIZE = "header_list_size"
    """A header block over the client's SETTINGS_MAX_HEADER_LIST_SIZE."""
    COMPRESSION = "compression"
    """A header block HPACK cannot decode."""
    COMPRESSED_MESSAGE = "compressed_message"
    """A gRPC message with the compressed flag (the client asks for identity only)."""
    SETTINGS_TIMEOUT = "settings_timeout"
    """The client's SETTINGS were not acknowledged in time (RFC 9113 §6.5.3)."""
    FLOOD = "flood"
    """PINGs or SETTINGS past what the client queues answers for while the server does not read
    them, or frames in a row that carry nothing past what the client takes (ENHANCE_YOUR_CALM)."""
    HANDSHAKE_TIMEOUT = "handshake_timeout"
    """No SETTINGS from the server (its HTTP/2 preface) within the channel's handshake bound."""
    INTERNAL = "internal"
    """The client itself failed on what it received (a bug): logged with its traceback."""


class ProtocolError(Exception):
    """A server's breach of the protocol: a connection error when ``stream_id`` is 0, else a
    stream error of that stream. ``message`` says what the server sent ("sent a WINDOW_UPDATE
    of 0 on the connection"); ``code`` is the HTTP/2 error code sent back."""

    def __init__(
        self, violation: str, code: ErrorCode, message: str, *, stream_id: int = 0
    ) -> None:
        super().__init__(f"{message} ({code.name})")
        self.violation = violation
        self.code = code
        self.message = message
        self.stream_id = stream_id
