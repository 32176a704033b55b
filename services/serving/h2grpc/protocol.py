"""gRPC calls on an HTTP/2 connection, sans I/O: the gRPC layer of h2grpc's core.

Where it cuts. Below: :class:`~services.serving.h2grpc.http2.H2ClientConnection`, which this
protocol's :class:`ClientProtocol` extends: HTTP/2's frames, streams, windows and settings, and
the rules a server must keep there; it calls this layer's hooks with a stream's response
headers, DATA and trailers, and when it ended a stream (why, as a
:class:`~services.serving.h2grpc.http2_base.StreamEnd`). Above: the asyncio layer,
:mod:`~services.serving.h2grpc.connection`, which starts calls (:meth:`ClientProtocol.open`),
takes their messages (:meth:`ClientProtocol.consumed`), resets them
(:meth:`ClientProtocol.reset`) and wakes their readers on :class:`StreamChanged`. What never
crosses: this layer writes no frame but through the connection's methods and keeps no window
(it reads a stream's ``credit`` only to skip a call that would send nothing); the connection
below reads no header value and no message. Every rule here is a unit test on
bytes (tests/unit/serving/test_h2grpc_protocol.py).

What it does (gRPC's PROTOCOL-HTTP2, :mod:`~services.serving.h2grpc.grpc_wire`): a request's
header block (built once per method, ``grpc-timeout`` and metadata appended) and its one
length-prefixed message; the response's ``:status`` and content-type; its messages cut from the
DATA frames; its trailers (``grpc-status``, ``grpc-message``, metadata); and each HTTP/2 outcome
as the status gRPC gives it (a RST_STREAM, GOAWAY, a breach, the connection's loss).

Backpressure: a streaming call's window is given back as its consumer reads (:meth:`consumed`),
not as bytes arrive: a call whose consumer stopped reading (a slow HTTP client) holds at most
:data:`~services.serving.h2grpc.http2_base.STREAM_WINDOW` of complete messages plus the window still
open to the server and one partial message (:attr:`Stream.held_bytes`); then the server can send
nothing more on that stream and waits. A unary call's answer is one message: its window is given
back as it arrives, and a second message fails the call.

What a server may send within the grammar is bounded too (issue 46): each unread message is
charged its size plus :data:`MESSAGE_COST` (its Python object), so empty or tiny messages stop the
window being given back, and a streaming call whose unread messages cost over
:data:`MAX_QUEUED_COST` fails RESOURCE_EXHAUSTED (RST_STREAM ENHANCE_YOUR_CALM); any message
appended wakes the reader, an empty one too. ``:status`` must be 3 ASCII digits and
``grpc-status`` ASCII digits (``str.isdigit`` takes "²", on which ``int`` raised inside the
receive path and closed the connection): else the call fails INTERNAL naming the value, as
grpc-go does; a number gRPC does not define is UNKNOWN, named. A 200 whose content-type is not
``application/grpc`` (an HTML page from a proxy) fails UNKNOWN naming it, as grpc-go does. A
compressed message fails its call INTERNAL naming the encoding (the client asks for identity), a
message over ``max_message_bytes`` RESOURCE_EXHAUSTED. Each breach comes out as a
:class:`~services.serving.h2grpc.http2_events.Breach` event.
"""

from __future__ import annotations

import base64
import binascii
import collections
import struct

import grpc

from services.serving.h2grpc import grpc_wire
from services.serving.h2grpc.errors import Metadata, Violation
from services.serving.h2grpc.frames import ErrorCode
from services.serving.h2grpc.hpack_decoder import Fields
from services.serving.h2grpc.http2 import H2ClientConnection
from services.serving.h2grpc.http2_base import CREDIT_BATCH, STREAM_WINDOW, H2Stream, StreamEnd
from services.serving.h2grpc.http2_events import Breach, Event

_QUEUE_LOW = STREAM_WINDOW // 2
"""A stream's window is opened again only while its unread messages are at most this."""
MESSAGE_COST = 56
"""What a received message costs the client beyond its bytes, and is charged against its stream
(:attr:`Stream.queued_bytes`): the ``bytes`` object's header (33 bytes, allocated in steps of 16)
and its slot in the stream's deque; more than the 5-byte prefix that carried it. Without it an
empty message (a default protobuf) was free, so the window was given back while the queue grew
without bound, and a 2-byte one cost 27 times what was counted."""
MAX_QUEUED_COST = 8 * STREAM_WINDOW
"""What a streaming call's unread messages may cost (:attr:`Stream.queued_bytes`). The window is
counted in bytes on the wire, so a window of messages of 0 to 2 bytes costs up to 10 times
itself in memory: past this bound (reached by such messages only) the call fails
RESOURCE_EXHAUSTED and its stream is reset ENHANCE_YOUR_CALM."""
_STATUS_OF_END = {
    StreamEnd.GOAWAY: grpc.StatusCode.UNAVAILABLE,
    StreamEnd.CONNECTION: grpc.StatusCode.UNAVAILABLE,
    StreamEnd.INTERNAL: grpc.StatusCode.INTERNAL,
    StreamEnd.STREAM_ERROR: grpc.StatusCode.INTERNAL,
    StreamEnd.HEADER_LIST_SIZE: grpc.StatusCode.RESOURCE_EXHAUSTED,
}
"""A call's status when HTTP/2 ended its stream (a RST_STREAM from the server:
:func:`~services.serving.h2grpc.grpc_wire.status_of_reset`)."""


class Stream(H2Stream):
    """One call's stream: what the server sent so far, then its status.

    ``messages`` fills as messages arrive; ``code`` is ``None`` while the call is open and its
    status once it ended (OK included), with ``details`` and trailing ``metadata``;
    ``unprocessed`` (HTTP/2's) says whether it may be sent again. The other fields are the
    protocol's: ``buffer`` (a message's bytes so far), ``encoding`` (the response's
    ``grpc-encoding``) and ``queued_bytes`` (complete messages not yet consumed, each charged
    its size plus :data:`MESSAGE_COST`); the stream's own are
    :class:`~services.serving.h2grpc.http2_base.H2Stream`'s.
    """

    __slots__ = (
        "buffer",
        "code",
        "details",
        "encoding",
        "messages",
        "metadata",
        "queued_bytes",
        "streaming",
    )

    def __init__(self, *, streaming: bool) -> None:
        H2Stream.__init__(self)  # not super(): 0.1 us less a call on Python 3.11
        self.streaming = streaming
        self.messages: collections.deque[bytes] = collections.deque()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.metadata: Metadata = ()
        self.buffer: bytes | bytearray = b""
        self.encoding = ""
        self.queued_bytes = 0

    @property
    def held_bytes(self) -> int:
        """The bytes the client holds for this call: messages not yet read (each with
        :data:`MESSAGE_COST`), a partial message, and request bytes not yet sent."""
        held = len(self.buffer) + super().held_bytes
        if self.streaming:
            return held + self.queued_bytes
        return held + sum(len(message) + MESSAGE_COST for message in self.messages)


class StreamChanged(Event):
    """``stream`` got messages (a streaming call) or ended (its ``code`` is set)."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream) -> None:
        self.stream = stream


class ClientProtocol(H2ClientConnection[Stream]):
    """gRPC calls on one HTTP/2 connection's client side (see the module docstring).
    ``target`` names the server in every message; ``authority`` and ``tls`` make the request
    headers."""

    def __init__(self, target: str, *, authority: bytes, tls: bool, max_message_bytes: int) -> None:
        super().__init__(target)
        self._authority = authority
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._prefixes: dict[bytes, bytes] = {}

    # -- what the client does -----------------------------------------------------------------

    def open(
        self,
        stream: Stream,
        path: bytes,
        payload: bytes,
        *,
        timeout_s: float | None,
        metadata: bytes = b"",
    ) -> None:
        """Start ``stream``: a request of ``path`` with one message, ``payload``, its
        ``grpc-timeout`` from ``timeout_s`` and ``metadata`` (encoded fields,
        :func:`~services.serving.h2grpc.grpc_wire.metadata_block`). What the server's windows do
        not take now is sent as they open. The caller checked :attr:`usable`."""
        block = self._prefixes.get(path)
        if block is None:
            block = grpc_wire.request_headers_prefix(path, self._authority, tls=self._tls)
            self._prefixes[path] = block
        if timeout_s is not None:
            block += grpc_wire.timeout_field(timeout_s)
        if metadata:
            block += metadata
        self._start_stream(stream, block, grpc_wire.message(payload))

    def consumed(self, stream: Stream, size: int) -> None:
        """The consumer took a message of ``size`` bytes from ``stream``: its window may open."""
        stream.queued_bytes -= size + MESSAGE_COST
        if (
            stream.credit >= CREDIT_BATCH
            and stream.queued_bytes <= _QUEUE_LOW
            and stream.code is None
        ):
            self._open_window(stream)

    def reset(
        self,
        stream: Stream,
        code: grpc.StatusCode,
        details: str,
        error: ErrorCode = ErrorCode.CANCEL,
    ) -> list[Event]:
        """End ``stream`` from the client's side: RST_STREAM ``error``, then the status."""
        self._reset(stream, code, details, error)
        return self._take_events()

    def _reset(
        self,
        stream: Stream,
        code: grpc.StatusCode,
        details: str,
        error: ErrorCode = ErrorCode.CANCEL,
    ) -> None:
        if stream.code is None:
            self._send_reset(stream, error)
            self._finish(stream, code, details)

    def _finish(
        self, stream: Stream, code: grpc.StatusCode, details: str, metadata: Metadata = ()
    ) -> None:
        if stream.code is not None:
            return
        stream.code, stream.details, stream.metadata = code, details, metadata
        self._events.append(StreamChanged(stream))
        self._close_stream(stream)

    # -- HTTP/2's events ------------------------------------------------------------------------

    def _stream_ended(self, stream: Stream, why: str, details: str, error: int) -> None:
        code = grpc_wire.status_of_reset(error) if why == StreamEnd.RESET else _STATUS_OF_END[why]
        self._finish(stream, code, details)

    def _data_received(self, stream: Stream, data: bytes, ended: bool) -> None:
        # A message over several frames gathers in a bytearray; whole ones are cut from the frame.
        buffer: bytes | bytearray = stream.buffer
        if buffer:
            buffer += data
        else:
            buffer = data
        position, size_now, queued, appended = 0, len(buffer), 0, 0
        while size_now - position >= grpc_wire.MESSAGE_PREFIX_BYTES:
            compressed, size = struct.unpack_from(">BL", buffer, position)
            if compressed:
                self._events.append(Breach(Violation.COMPRESSED_MESSAGE))
                self._reset(
                    stream,
                    grpc.StatusCode.INTERNAL,
                    f"compressed gRPC messages are not supported ({self.target} sent one, "
                    f"grpc-encoding {stream.encoding or '(none)'}, to a client that accepts "
                    f"identity only)",
                )
                return
            if size > self._max_message_bytes:
                self._reset(
                    stream,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({size} vs. {self._max_message_bytes})",
                )
                return
            end = position + grpc_wire.MESSAGE_PREFIX_BYTES + size
            if end > size_now:
                break
            if not stream.streaming and stream.messages:
                self._reset(
                    stream,
                    grpc.StatusCode.INTERNAL,
                    f"a unary answer from {self.target} had 2 messages",
                )
                return
            stream.messages.append(bytes(buffer[position + grpc_wire.MESSAGE_PREFIX_BYTES : end]))
            queued += size
            appended += 1
            position = end
        if position == size_now:
            stream.buffer = b""
        elif position or not isinstance(buffer, bytearray):
            stream.buffer = bytearray(buffer[position:])
        else:
            stream.buffer = buffer
        if ended:
            self._finish(
                stream, grpc.StatusCode.INTERNAL, "the server ended the stream without trailers"
            )
            return
        # Bytes read are given back at once but for complete messages of a streaming call,
        # which count as read when the consumer takes them (consumed).
        if stream.streaming:
            if appended:  # an empty message too wakes the reader
                stream.queued_bytes += queued + appended * MESSAGE_COST
                if stream.queued_bytes > MAX_QUEUED_COST:
                    self._events.append(Breach(Violation.FLOOD))
                    count, held = len(stream.messages), stream.queued_bytes
                    stream.messages.clear()  # the call failed: what it held goes now
                    stream.queued_bytes = 0
                    self._reset(
                        stream,
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{self.target} sent {count} messages the reader has not taken, costing "
                        f"{held} bytes held, over the "
                        f"{MAX_QUEUED_COST} bound (messages of a few bytes each)",
                        ErrorCode.ENHANCE_YOUR_CALM,
                    )
                    return
                self._events.append(StreamChanged(stream))
            if stream.credit >= CREDIT_BATCH and stream.queued_bytes <= _QUEUE_LOW:
                self._open_window(stream)
        elif stream.credit >= CREDIT_BATCH:
            self._open_window(stream)

    def _response_received(self, stream: Stream, fields: Fields, ended: bool) -> None:
        status = content_type = ""
        for name, value in fields:
            if name == ":status":
                status = value
            elif name == "content-type":
                content_type = value
            elif name == "grpc-encoding":
                stream.encoding = value
        if status != "200":
            number = _number(status, 3) if len(status) == 3 else None
            if status and number is None:
                self._events.append(Breach(Violation.MALFORMED))
                self._refuse_answer(
                    stream,
                    ended,
                    grpc.StatusCode.INTERNAL,
                    f"{self.target} sent a malformed :status {_shown(status)} (not 3 ASCII digits)",
                    ErrorCode.PROTOCOL_ERROR,
                )
                return
            self._refuse_answer(
                stream,
                ended,
                grpc_wire.status_of_http(number or 0),
                f"HTTP status {status or 'missing'} from {self.target} (not a gRPC answer)",
            )
            return
        # As grpc-go: a 200 that is not gRPC's content (an HTML page from a proxy) is
        # UNKNOWN, named; a Trailers-Only answer without one is taken (grpc-core does).
        if (
            content_type != "application/grpc"
            and (content_type or not ended)
            and not _is_grpc(content_type)
        ):
            self._refuse_answer(
                stream,
                ended,
                grpc.StatusCode.UNKNOWN,
                f"{self.target} answered HTTP 200 with content-type "
                f"{_shown(content_type) if content_type else '(none)'}, not "
                f"application/grpc (not a gRPC answer)",
                ErrorCode.PROTOCOL_ERROR,
            )
            return
        if ended:
            self._trailers_received(stream, fields)

    def _refuse_answer(
        self,
        stream: Stream,
        ended: bool,
        code: grpc.StatusCode,
        details: str,
        error: ErrorCode = ErrorCode.CANCEL,
    ) -> None:
        """End ``stream`` on an answer that is not gRPC's: RST_STREAM ``error`` unless the
        server ended it."""
        if ended:
            self._finish(stream, code, details)
        else:
            self._reset(stream, code, details, error)

    def _trailers_received(self, stream: Stream, fields: Fields) -> None:
        code: grpc.StatusCode | None = None
        details = status = ""
        metadata: list[tuple[str, str | bytes]] = []
        for name, value in fields:
            if name == "grpc-status":
                status = value
                if value == "0":
                    code = grpc.StatusCode.OK
                    continue
                number = _number(value, 10)
                if number is None:
                    # grpc-go's answer: INTERNAL, named (not UNKNOWN with the details empty).
                    self._events.append(Breach(Violation.MALFORMED))
                    self._finish(
                        stream,
                        grpc.StatusCode.INTERNAL,
                        f"{self.target} sent a malformed grpc-status {_shown(value)} (not a "
                        f"decimal number)",
                    )
                    return
                code = grpc_wire.STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
            elif name == "grpc-message":
                details = grpc_wire.grpc_message(value)
            elif name.endswith("-bin"):
                try:
                    metadata.append((name, base64.b64decode(value + "==")))
                except binascii.Error:
                    self._events.append(Breach(Violation.MALFORMED))
                    self._finish(
                        stream,
                        grpc.StatusCode.INTERNAL,
                        f"{self.target} sent binary metadata {name} that is not base64",
                    )
                    return
            elif not name.startswith((":", "grpc-")) and name != "content-type":
                metadata.append((name, value))
        if code is None:
            code, details = grpc.StatusCode.UNKNOWN, "the server's trailers carry no grpc-status"
        elif code is grpc.StatusCode.UNKNOWN and status != "2" and not details:
            details = f"{self.target} sent grpc-status {status}, which gRPC does not define"
        elif code is grpc.StatusCode.OK and stream.buffer:
            code, details = grpc.StatusCode.INTERNAL, "the stream ended inside a message"
        self._finish(stream, code, details, tuple(metadata))


def _number(value: str, digits: int) -> int | None:
    """``value`` as a decimal number of at most ``digits`` ASCII digits, else ``None``
    (``str.isdigit`` takes "²" and ``int`` then raises; 5,000 digits raise too)."""
    if 0 < len(value) <= digits and value.isascii() and value.isdigit():
        return int(value)
    return None


def _is_grpc(content_type: str) -> bool:
    """gRPC's content-type: ``application/grpc``, alone or with ``+codec`` or ``;params``."""
    head = content_type[:17].lower()
    return head == "application/grpc" or head in ("application/grpc+", "application/grpc;")


def _shown(value: str) -> str:
    """A header value in an error message: quoted, cut at 40 characters."""
    return repr(value[:40]) + (f" ({len(value)} characters)" if len(value) > 40 else "")
