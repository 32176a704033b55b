"""gRPC calls on an HTTP/2 connection, sans I/O: the gRPC layer of h2grpc's core.

Where it cuts. Below: :class:`~services.serving.h2grpc.http2.H2ClientConnection`, which this
protocol's :class:`ClientProtocol` extends: HTTP/2's frames, streams, windows and settings, and
the rules a server must keep there; it calls this layer's hooks with a stream's response
headers, DATA and trailers, and when it ended a stream (why, as a
:class:`~services.serving.h2grpc.http2_base.StreamEnd`). Above: the asyncio layer,
:mod:`~services.serving.h2grpc.connection`, which starts calls (:meth:`ClientProtocol.open`),
takes their messages (:meth:`ClientProtocol.take`), resets them
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

Backpressure: a streaming call's window is given back as its consumer reads (:meth:`take`), not
as bytes arrive: a call whose consumer stopped reading (a slow HTTP client) holds at most
:data:`~services.serving.h2grpc.http2_base.STREAM_WINDOW` of complete messages plus the window still
open to the server and one partial message (:attr:`Stream.held_bytes`); then the server can send
nothing more on that stream and waits. A unary call's answer is one message: its window is given
back as it arrives, and a second message fails the call.

Unread messages are held as they came, as the bytes on the wire (:class:`Stream`'s ``ready``
and ``wire``), and a message is cut out when the consumer takes it: what a stopped reader holds
is what the window let in, whatever the messages' size. (Held as a ``bytes`` object each, a
message cost its size plus about 56 bytes, so a window of empty or tiny messages cost over 10
times itself in memory; issue 46 charged that and failed a call past 8 MiB, which a server
within its window reached with messages of 0-2 bytes.) Any message appended wakes the reader,
an empty one too.

What a server may send within the grammar is bounded too (issue 46). ``:status`` must be 3
ASCII digits and ``grpc-status`` ASCII digits (``str.isdigit`` takes "²", on which ``int``
raised inside the receive path and closed the connection): else the call fails INTERNAL naming
the value, as grpc-go does; a number gRPC does not define is UNKNOWN, named. A 200 whose
content-type is not ``application/grpc`` (an HTML page from a proxy) fails UNKNOWN naming it, as
grpc-go does. A compressed message fails its call INTERNAL naming the encoding (the client asks
for identity), a message over ``max_message_bytes`` RESOURCE_EXHAUSTED. Each breach comes out as a
:class:`~services.serving.h2grpc.http2_events.Breach` event.
"""

from __future__ import annotations

import base64
import binascii
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
"""A stream's window is opened again only while its unread messages are at most this (bytes)."""
_PREFIX = struct.Struct(">BL").unpack_from
_LENGTH = struct.Struct(">L").unpack_from
_PREFIX_BYTES = grpc_wire.MESSAGE_PREFIX_BYTES
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

    ``unread`` counts the complete messages not yet taken (:meth:`ClientProtocol.take` cuts
    the next one out); ``code`` is ``None`` while the call is open and its status once it
    ended (OK included), with ``details`` and trailing ``metadata``; ``unprocessed`` (HTTP/2's)
    says whether it may be sent again. The other fields are the protocol's, the bytes received
    as they came (messages with their 5-byte prefixes) in two parts: ``ready`` (complete
    messages the reader takes from, up to ``read_to`` taken) and ``wire`` (what came since:
    complete messages up to ``complete_to``, then a partial one), which becomes ``ready`` when
    the reader took all of that (so a frame's bytes are not copied when the reader keeps up,
    and each message of a backlog is cut from ``bytes``); ``encoding`` (the response's
    ``grpc-encoding``); the stream's own are
    :class:`~services.serving.h2grpc.http2_base.H2Stream`'s.
    """

    __slots__ = (
        "code",
        "complete_to",
        "details",
        "encoding",
        "metadata",
        "read_to",
        "ready",
        "streaming",
        "unread",
        "wire",
    )

    def __init__(self, *, streaming: bool) -> None:
        H2Stream.__init__(self)  # not super(): 0.1 us less a call on Python 3.11
        self.streaming = streaming
        self.unread = 0
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.metadata: Metadata = ()
        self.ready = b""
        self.wire: bytes | bytearray = b""
        self.read_to = self.complete_to = 0
        self.encoding = ""

    @property
    def held_bytes(self) -> int:
        """The bytes the client holds for this call: received (complete messages and a
        partial one, as they came; taken ones until the rest of their ``ready`` part is), and
        request bytes not yet sent."""
        return len(self.ready) + len(self.wire) + super().held_bytes


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

    def take(self, stream: Stream) -> bytes:
        """The next message of ``stream`` (the caller saw ``stream.unread``), cut from what it
        holds: read, so a streaming call's window may open."""
        ready, read_to = stream.ready, stream.read_to
        if not ready:  # all taken: what came since is next
            wire = stream.wire
            if stream.complete_to == len(wire) and isinstance(wire, bytes):
                ready = stream.ready = wire  # the frame as it came (the reader keeps up)
                stream.wire = b""
                stream.complete_to = 0
            else:
                ready = _make_ready(stream)
        start = read_to + _PREFIX_BYTES
        end = start + _LENGTH(ready, read_to + 1)[0]
        if end == len(ready):  # all taken: let it go
            stream.ready, stream.read_to = b"", 0
        else:
            stream.read_to = end
        stream.unread -= 1
        if (
            stream.credit >= CREDIT_BATCH
            and stream.streaming
            and len(ready) - end + stream.complete_to <= _QUEUE_LOW
            and stream.code is None
        ):
            self._open_window(stream)
        return ready[start:end]

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
        # The frame's bytes join what came since the reader's ready part (the frame itself when
        # nothing did: no copy); complete messages are counted here, cut when taken.
        wire = stream.wire
        if wire:
            if isinstance(wire, bytes):
                wire = bytearray(wire)
            wire += data
        else:
            wire = data
        stream.wire = wire
        position, size_now, appended = stream.complete_to, len(wire), 0
        while size_now - position >= _PREFIX_BYTES:
            compressed, size = _PREFIX(wire, position)
            if compressed:
                self._events.append(Breach(Violation.COMPRESSED_MESSAGE))
                self._refuse_message(
                    stream,
                    position,
                    appended,
                    grpc.StatusCode.INTERNAL,
                    f"compressed gRPC messages are not supported ({self.target} sent one, "
                    f"grpc-encoding {stream.encoding or '(none)'}, to a client that accepts "
                    f"identity only)",
                )
                return
            if size > self._max_message_bytes:
                self._refuse_message(
                    stream,
                    position,
                    appended,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({size} vs. {self._max_message_bytes})",
                )
                return
            end = position + _PREFIX_BYTES + size
            if end > size_now:
                break
            if not stream.streaming and (appended or stream.unread):
                self._refuse_message(
                    stream,
                    position,
                    appended,
                    grpc.StatusCode.INTERNAL,
                    f"a unary answer from {self.target} had 2 messages",
                )
                return
            appended += 1
            position = end
        stream.complete_to = position
        stream.unread += appended
        if ended:
            self._finish(
                stream, grpc.StatusCode.INTERNAL, "the server ended the stream without trailers"
            )
            return
        # Bytes read are given back at once but for complete messages of a streaming call,
        # which count as read when the consumer takes them (take).
        if stream.streaming:
            if appended:  # an empty message too wakes the reader
                self._events.append(StreamChanged(stream))
            if (
                stream.credit >= CREDIT_BATCH
                and position + len(stream.ready) - stream.read_to <= _QUEUE_LOW
            ):
                self._open_window(stream)
        elif stream.credit >= CREDIT_BATCH:
            self._open_window(stream)

    def _refuse_message(
        self,
        stream: Stream,
        position: int,
        appended: int,
        code: grpc.StatusCode,
        details: str,
    ) -> None:
        """End ``stream`` on a message it may not take, at ``position`` of its ``wire``: the
        ``appended`` complete messages before it stay readable, the rest goes."""
        stream.wire = stream.wire[:position]
        stream.complete_to = position
        stream.unread += appended
        self._reset(stream, code, details)

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
        elif code is grpc.StatusCode.OK and len(stream.wire) > stream.complete_to:
            code, details = grpc.StatusCode.INTERNAL, "the stream ended inside a message"
        self._finish(stream, code, details, tuple(metadata))


def _make_ready(stream: Stream) -> bytes:
    """``stream``'s complete messages that came since its ``ready`` part (all taken), copied
    out as the new ``ready`` (the reader fell behind, or a message crossed frames)."""
    wire, complete_to = stream.wire, stream.complete_to
    if complete_to == len(wire):
        ready = bytes(wire)
        stream.wire = b""
    else:
        ready = bytes(wire[:complete_to])
        if isinstance(wire, bytes):
            stream.wire = wire[complete_to:]
        else:
            del wire[:complete_to]  # CPython moves the bytearray's start: the rest stays put
    stream.ready = ready
    stream.complete_to = 0
    return ready


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
