"""The client's end of one HTTP/2 connection carrying gRPC calls, sans I/O: bytes in, events out.

:class:`ClientProtocol` holds one connection's HTTP/2 state and its calls' streams
(:class:`Stream`). It does no I/O and knows no event loop and no clock:
:meth:`ClientProtocol.receive` takes the bytes the server sent and returns what happened as
:class:`Event` objects; everything that queues frames (a request, a reset, a WINDOW_UPDATE, a
PING's answer) leaves them for :meth:`ClientProtocol.data_to_send`. The asyncio layer above,
:mod:`~services.serving.h2grpc.connection`, moves the bytes, keeps the timers (a call's deadline,
keepalive, the SETTINGS-ACK timeout) and wakes the calls' waiters. So each rule here is a unit test
on bytes (tests/unit/serving/test_h2grpc_protocol.py).

What it does: the preface and SETTINGS (the server's limits: concurrent streams, frame size,
initial window), PING answers, GOAWAY (streams above its last stream id end UNAVAILABLE, marked
:attr:`Stream.unprocessed`: safe to retry elsewhere; no new stream starts), RST_STREAM
(REFUSED_STREAM before any answer is also ``unprocessed``, RFC 9113 §8.7), a response's headers,
length-prefixed messages and trailers.

Flow control, both ways:

- Sending: a request larger than the server's windows is sent as WINDOW_UPDATEs open them
  (:attr:`Stream.unsent` holds the rest; the call's deadline bounds the wait).
- Receiving: each stream's window is :data:`STREAM_WINDOW` and is given back as the consumer reads
  (:meth:`ClientProtocol.consumed`), not as bytes arrive. A streaming call whose consumer stopped
  reading (a slow HTTP client) holds at most :data:`STREAM_WINDOW` of complete messages plus the
  window still open to the server and one partial message (:attr:`Stream.held_bytes`); then the
  server can send nothing more on that stream and waits, which is the backpressure from the HTTP
  client to the engine. A unary call's answer is one message: its window is given back as it
  arrives, and a second message fails the call. The connection's window is opened to the maximum
  and topped up as data arrives: the streams' windows are the bound, so one slow call never holds
  up the others.

A server's breach of the protocol is handled as RFC 9113 §5.4 says, checked by
:mod:`~services.serving.h2grpc.rules`: a connection error queues GOAWAY with its error code, ends
every stream UNAVAILABLE with a message naming the breach and returns :class:`ConnectionEnded`;
a stream error queues RST_STREAM and ends that call INTERNAL. DATA past a window the client
opened is a FLOW_CONTROL_ERROR (past the connection's: a connection error; past a stream's: a
stream error). Bounds: a received frame over the advertised SETTINGS_MAX_FRAME_SIZE (16 KiB, the
default) is a FRAME_SIZE_ERROR before its payload is read, so the bytes held for an unfinished
frame stay under it; a header block over the advertised SETTINGS_MAX_HEADER_LIST_SIZE
(:data:`~services.serving.h2grpc.frames.MAX_HEADER_LIST_SIZE`) fails its call RESOURCE_EXHAUSTED,
and also closes the connection when it was still gathering (CONTINUATION), since an abandoned
block leaves HPACK's state behind (§4.3, COMPRESSION_ERROR); each frame of a block is charged its
9-byte header besides its payload, so empty CONTINUATIONs reach that bound too. A compressed
message fails its call INTERNAL naming the encoding (the client asks for identity).

What a server may send within the grammar is bounded too (issue 46): each unread message is
charged its size plus :data:`MESSAGE_COST` (its Python object), so empty or tiny messages stop the
window being given back, and a streaming call whose unread messages cost over
:data:`MAX_QUEUED_COST` fails RESOURCE_EXHAUSTED (RST_STREAM ENHANCE_YOUR_CALM); any message
appended wakes the reader, an empty one too. ``:status`` must be 3 ASCII digits and
``grpc-status`` ASCII digits (``str.isdigit`` takes "²", on which ``int`` raised inside the
receive path and closed the connection): else the call fails INTERNAL naming the value, as
grpc-go does; a number gRPC does not define is UNKNOWN, named. A 200 whose content-type is not
``application/grpc`` (an HTML page from a proxy) fails UNKNOWN naming it, as grpc-go does. More
than :data:`MAX_UNWRITTEN_REPLIES` answers to PINGs and SETTINGS queued before the I/O layer says
its writes drained (:meth:`ClientProtocol.written`) end the connection ENHANCE_YOUR_CALM.

Anything else that goes wrong while receiving is a connection error INTERNAL_ERROR with the
exception named: nothing escapes :meth:`ClientProtocol.receive`. Each breach comes out as a
:class:`Breach` event (:class:`~services.serving.h2grpc.errors.Violation` labels).
"""

from __future__ import annotations

import base64
import binascii
import collections
import logging
import struct

import grpc
from hpack import HPACKDecodingError

from services.serving.h2grpc import frames, rules
from services.serving.h2grpc.errors import Metadata, ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode, Flag, FrameType, Setting
from services.serving.h2grpc.hpack_decoder import Fields, HeaderListTooLarge, HpackDecoder

logger = logging.getLogger(__name__)

STREAM_WINDOW = 1 << 20
"""Each stream's receive window (SETTINGS_INITIAL_WINDOW_SIZE): what a call may have in flight
from the server beyond what its consumer has read. grpclib uses 4 MiB, grpc-core starts at 64 KiB
and grows it by its BDP estimate; pdserve's engines stream small messages (a few tokens each), so
1 MiB never stalls a stream that is read, and bounds one that is not."""
_CREDIT_BATCH = STREAM_WINDOW // 4
"""Bytes read before a stream's window is opened again (one WINDOW_UPDATE per batch)."""
_QUEUE_LOW = STREAM_WINDOW // 2
"""A stream's window is opened again only while its unread messages are at most this."""
_MAX_FRAME_RECEIVED = frames.DEFAULT_MAX_FRAME
"""The SETTINGS_MAX_FRAME_SIZE the client lives with (the default, so not sent)."""
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
MAX_UNWRITTEN_REPLIES = 1000
"""SETTINGS ACKs and PING answers the client queues while the transport has not written the
previous ones (nghttp2's ``max_outbound_ack``): a server that keeps asking and does not read
gets GOAWAY ENHANCE_YOUR_CALM past it, instead of the router's memory."""
_CLIENT_SETTINGS = frames.settings(
    {
        Setting.ENABLE_PUSH: 0,
        Setting.INITIAL_WINDOW_SIZE: STREAM_WINDOW,
        Setting.MAX_HEADER_LIST_SIZE: frames.MAX_HEADER_LIST_SIZE,
    }
) + frames.window_update(0, frames.MAX_WINDOW - frames.DEFAULT_WINDOW)


class Stream:
    """One call's stream: what the server sent so far, then its status.

    ``messages`` fills as messages arrive; ``code`` is ``None`` while the call is open and its
    status once it ended (OK included), with ``details`` and trailing ``metadata``.
    ``unprocessed``: why the server never processed it, when it ended so (``"refused_stream"``:
    REFUSED_STREAM before an answer; ``"goaway"``: above a GOAWAY's last stream id), else ``""``:
    such a call may be sent again. The other fields are
    the protocol's: ``buffer`` (a message's bytes so far), ``headers_seen``, ``encoding`` (the
    response's ``grpc-encoding``), ``send_window``, ``unsent`` (request bytes waiting for it),
    ``receive_window``, ``credit`` (bytes read but not yet given back to the server) and
    ``queued_bytes`` (complete messages not yet consumed, each charged its size plus
    :data:`MESSAGE_COST`).
    """

    __slots__ = (
        "buffer",
        "code",
        "credit",
        "details",
        "encoding",
        "headers_seen",
        "messages",
        "metadata",
        "queued_bytes",
        "receive_window",
        "send_window",
        "stream_id",
        "streaming",
        "unprocessed",
        "unsent",
    )

    def __init__(self, *, streaming: bool) -> None:
        self.streaming = streaming
        self.stream_id = 0
        self.messages: collections.deque[bytes] = collections.deque()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.metadata: Metadata = ()
        self.unprocessed = ""
        self.buffer: bytes | bytearray = b""
        self.headers_seen = False
        self.encoding = ""
        self.send_window = 0
        self.unsent: memoryview | None = None
        self.receive_window = STREAM_WINDOW
        self.credit = 0
        self.queued_bytes = 0

    @property
    def held_bytes(self) -> int:
        """The bytes the client holds for this call: messages not yet read (each with
        :data:`MESSAGE_COST`), a partial message, and request bytes not yet sent."""
        held = len(self.buffer) + (len(self.unsent) if self.unsent is not None else 0)
        if self.streaming:
            return held + self.queued_bytes
        return held + sum(len(message) + MESSAGE_COST for message in self.messages)


class Event:
    """What :meth:`ClientProtocol.receive` (and the other calls that end streams) report."""

    __slots__ = ()


class StreamChanged(Event):
    """``stream`` got messages (a streaming call) or ended (its ``code`` is set)."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream) -> None:
        self.stream = stream


class Settled(Event):
    """The server's first SETTINGS came: its limits are known, calls may start."""

    __slots__ = ()


class SettingsAcknowledged(Event):
    """The server acknowledged the client's SETTINGS."""

    __slots__ = ()


class PingAcknowledged(Event):
    """The server answered the client's PING."""

    __slots__ = ()


class SlotsChanged(Event):
    """Whether a stream may start changed: a stream ended at the server's concurrency limit, the
    limit changed, or a GOAWAY came (no stream starts any more)."""

    __slots__ = ()


class Breach(Event):
    """The server broke the protocol (``violation``: a
    :class:`~services.serving.h2grpc.errors.Violation` label); what it ended is reported too."""

    __slots__ = ("violation",)

    def __init__(self, violation: str) -> None:
        self.violation = violation


class ConnectionEnded(Event):
    """The protocol ended the connection (a connection error, queued GOAWAY included): send what
    :meth:`ClientProtocol.data_to_send` holds, then close the transport. Every stream has ended
    with ``reason``."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


_SETTLED = Settled()
_SETTINGS_ACKNOWLEDGED = SettingsAcknowledged()
_PING_ACKNOWLEDGED = PingAcknowledged()
_SLOTS_CHANGED = SlotsChanged()


class ClientProtocol:
    """One HTTP/2 connection's client side (see the module docstring). ``target`` names the
    server in every message; ``authority`` and ``tls`` make the request headers."""

    def __init__(self, target: str, *, authority: bytes, tls: bool, max_message_bytes: int) -> None:
        self.target = target
        self._authority = authority
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._out: list[bytes] = [frames.PREFACE + _CLIENT_SETTINGS]
        self._events: list[Event] = []
        self._decoder = HpackDecoder(frames.MAX_HEADER_LIST_SIZE)
        self._pending = b""
        self._header_block: tuple[int, int, bytearray] | None = None
        self._header_charge = 0
        """What the header block being gathered counts against its bound: its bytes and each
        of its frames' 9-byte header, so empty CONTINUATIONs reach the bound too."""
        self._continuations = 0
        self._unwritten_replies = 0
        self.streams: dict[int, Stream] = {}
        """The open streams by id."""
        self._next_stream_id = 1
        self._prefixes: dict[bytes, bytes] = {}
        self._first_block = True
        self._peer_initial_window = frames.DEFAULT_WINDOW
        self._peer_max_frame = frames.DEFAULT_MAX_FRAME
        self.peer_max_streams = 2**31
        self._send_window = frames.DEFAULT_WINDOW
        self._receive_window = frames.MAX_WINDOW
        self._blocked: list[Stream] = []
        self.settled = False
        self.going_away = False
        self.goaway_reason: str | None = None
        """What the server's GOAWAY said, once one came."""
        self.closed_reason: str | None = None
        """Why the connection is closing or closed; ``None`` while it is usable."""

    # -- state ------------------------------------------------------------------------------

    @property
    def usable(self) -> bool:
        """Whether a new stream may start: not closed, no GOAWAY, stream ids left."""
        return (
            self.closed_reason is None
            and not self.going_away
            and self._next_stream_id < frames.MAX_WINDOW
        )

    @property
    def has_room(self) -> bool:
        """Whether the server's MAX_CONCURRENT_STREAMS leaves room for one more stream."""
        return len(self.streams) < self.peer_max_streams

    @property
    def held_bytes(self) -> int:
        """The bytes the connection holds: its streams' (:attr:`Stream.held_bytes`), an
        unfinished frame's, and a header block's gathered so far (HEADERS then CONTINUATIONs)."""
        held = len(self._pending) + sum(stream.held_bytes for stream in self.streams.values())
        return held + (len(self._header_block[2]) if self._header_block is not None else 0)

    def data_to_send(self) -> bytes:
        """The bytes queued for the server since the last call (and forgets them)."""
        out, self._out = self._out, []
        return b"".join(out) if len(out) != 1 else out[0]

    @property
    def has_data_to_send(self) -> bool:
        return bool(self._out)

    @property
    def unwritten_replies(self) -> int:
        """SETTINGS ACKs and PING answers queued since the I/O layer last said its writes
        drained (:meth:`written`); past :data:`MAX_UNWRITTEN_REPLIES` the connection ends
        ENHANCE_YOUR_CALM."""
        return self._unwritten_replies

    def written(self) -> None:
        """The I/O layer wrote everything out (its transport's buffer is empty): the server
        took the answers queued so far."""
        self._unwritten_replies = 0

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
        :func:`~services.serving.h2grpc.frames.metadata_block`). What the server's windows do not
        take now is sent as they open. The caller checked :attr:`usable`."""
        assert self.usable
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        stream.stream_id = stream_id
        stream.send_window = self._peer_initial_window
        self.streams[stream_id] = stream
        block = self._prefixes.get(path)
        if block is None:
            block = frames.request_headers_prefix(path, self._authority, tls=self._tls)
            self._prefixes[path] = block
        if self._first_block:
            block = frames.TABLE_SIZE_ZERO + block
            self._first_block = False
        if timeout_s is not None:
            block += frames.timeout_field(timeout_s)
        if metadata:
            block += metadata
        headers = frames.frame(FrameType.HEADERS, Flag.END_HEADERS, stream_id, block)
        body = frames.message(payload)
        size = len(body)
        if size <= min(self._peer_max_frame, self._send_window, stream.send_window):
            self._send_window -= size
            stream.send_window -= size
            data = frames.frame(FrameType.DATA, Flag.END_STREAM, stream_id, body)
            self._out.append(headers + data)
        else:
            self._out.append(headers)
            stream.unsent = memoryview(body)
            self._send_unsent(stream)
            if stream.unsent is not None:
                self._blocked.append(stream)

    def _send_unsent(self, stream: Stream) -> None:
        """As much of ``stream``'s request as the windows take."""
        view = stream.unsent
        while view is not None:
            room = min(self._peer_max_frame, self._send_window, stream.send_window, len(view))
            if room <= 0:
                break
            chunk, view = view[:room], view[room:]
            self._send_window -= room
            stream.send_window -= room
            flags = Flag.END_STREAM if not view else 0
            self._out.append(frames.frame(FrameType.DATA, flags, stream.stream_id, bytes(chunk)))
            if not view:
                view = None
        stream.unsent = view

    def _send_blocked(self) -> None:
        """The requests that wait for windows, after a window opened."""
        for stream in self._blocked:
            if stream.code is None:
                self._send_unsent(stream)
        self._blocked = [s for s in self._blocked if s.unsent is not None and s.code is None]

    def consumed(self, stream: Stream, size: int) -> None:
        """The consumer took a message of ``size`` bytes from ``stream``: its window may open."""
        stream.queued_bytes -= size + MESSAGE_COST
        if (
            stream.credit >= _CREDIT_BATCH
            and stream.queued_bytes <= _QUEUE_LOW
            and stream.code is None
        ):
            self._give_credit(stream)

    def _give_credit(self, stream: Stream) -> None:
        self._out.append(frames.window_update(stream.stream_id, stream.credit))
        stream.receive_window += stream.credit
        stream.credit = 0

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
            self._out.append(frames.rst_stream(stream.stream_id, error))
            self._finish(stream, code, details)

    def ping(self, payload: bytes) -> None:
        """A keepalive PING (8 bytes); its answer comes as :class:`PingAcknowledged`."""
        self._out.append(frames.ping(payload))

    def close(self, reason: str) -> None:
        """A graceful close: GOAWAY NO_ERROR queued; the transport's loss ends what is open."""
        if self.closed_reason is None:
            self.closed_reason = reason
            self._out.append(frames.goaway(0, ErrorCode.NO_ERROR))

    def fail(self, error: ProtocolError) -> list[Event]:
        """A connection error the client found outside a frame (the SETTINGS-ACK timeout)."""
        self._connection_error(error)
        return self._take_events()

    def connection_lost(self, reason: str) -> list[Event]:
        """The transport is gone: every stream ends UNAVAILABLE with ``reason`` (or the reason
        the connection was closing for)."""
        self._end_all(self.closed_reason or reason, grpc.StatusCode.UNAVAILABLE)
        return self._take_events()

    # -- ending streams -------------------------------------------------------------------------

    def _finish(
        self, stream: Stream, code: grpc.StatusCode, details: str, metadata: Metadata = ()
    ) -> None:
        if stream.code is not None:
            return
        stream.code, stream.details, stream.metadata = code, details, metadata
        stream.unsent = None
        at_limit = len(self.streams) >= self.peer_max_streams
        self.streams.pop(stream.stream_id, None)
        self._events.append(StreamChanged(stream))
        if at_limit:
            self._events.append(_SLOTS_CHANGED)

    def _end_all(self, reason: str, code: grpc.StatusCode) -> None:
        self.closed_reason = reason
        for stream in list(self.streams.values()):
            self._finish(stream, code, reason)
        self._events.append(_SLOTS_CHANGED)

    def _connection_error(
        self, error: ProtocolError, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    ) -> None:
        """RFC 9113 §5.4.1: GOAWAY with the error (last stream 0: the client accepts no stream
        of the server's), every stream ended ``code``."""
        if self.closed_reason is not None and not self.streams:
            return  # already ended
        reason = f"{self.target} {error}"
        logger.warning("HTTP/2 connection to %s closed: %s", self.target, reason)
        self._events.append(Breach(error.violation))
        self._out.append(frames.goaway(0, error.code, error.message.encode()[:256]))
        self._end_all(reason, code)
        self._events.append(ConnectionEnded(reason))

    def _stream_error(self, error: ProtocolError) -> None:
        """RFC 9113 §5.4.2: RST_STREAM with the error, that call ended INTERNAL."""
        self._events.append(Breach(error.violation))
        stream = self.streams.get(error.stream_id)
        if stream is not None:
            self._out.append(frames.rst_stream(stream.stream_id, error.code))
            self._finish(stream, grpc.StatusCode.INTERNAL, f"{self.target} {error}")

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    # -- receiving ----------------------------------------------------------------------------

    def receive(self, data: bytes) -> list[Event]:
        """The server's bytes: what they changed. Never raises."""
        if self.closed_reason is not None and not self.streams:
            return []
        try:
            self._receive(data)
        except ProtocolError as error:
            self._connection_error(error)
        except Exception as exc:
            logger.exception("h2grpc failed on what %s sent", self.target)
            self._connection_error(
                ProtocolError(
                    Violation.INTERNAL,
                    ErrorCode.INTERNAL_ERROR,
                    f"sent frames the client failed on ({exc!r})",
                ),
                grpc.StatusCode.INTERNAL,
            )
        return self._take_events()

    def _receive(self, data: bytes) -> None:
        """The frames in ``data``; raises :class:`ProtocolError` for a connection error."""
        if self._pending:
            data = self._pending + data
        offset, end = 0, len(data)
        while end - offset >= frames.FRAME_HEADER_BYTES:
            length, kind, flags, stream_id = frames.parse_frame_header(data, offset)
            if length > _MAX_FRAME_RECEIVED or not stream_id or kind > FrameType.HEADERS:
                rules.check_frame_header(length, kind, flags, stream_id, _MAX_FRAME_RECEIVED)
            start = offset + frames.FRAME_HEADER_BYTES
            if end - start < length:
                break
            payload = data[start : start + length]
            offset = start + length
            if self._header_block is not None and kind != FrameType.CONTINUATION:
                raise ProtocolError(
                    Violation.MALFORMED,
                    ErrorCode.PROTOCOL_ERROR,
                    f"interrupted the header block of stream {self._header_block[0]}",
                )
            try:
                if kind == FrameType.DATA:
                    self._on_data(stream_id, flags, payload)
                elif kind == FrameType.HEADERS:
                    self._on_headers(stream_id, flags, payload)
                elif kind == FrameType.CONTINUATION:
                    self._on_continuation(stream_id, flags, payload)
                elif kind == FrameType.RST_STREAM:
                    self._on_reset(stream_id, payload)
                elif kind == FrameType.SETTINGS:
                    self._on_settings(flags, payload)
                elif kind == FrameType.PING:
                    self._on_ping(flags, payload)
                elif kind == FrameType.GOAWAY:
                    self._on_goaway(payload)
                elif kind == FrameType.WINDOW_UPDATE:
                    self._on_window_update(stream_id, payload)
                elif kind == FrameType.PUSH_PROMISE:
                    raise ProtocolError(
                        Violation.MALFORMED,
                        ErrorCode.PROTOCOL_ERROR,
                        "sent a PUSH_PROMISE with push disabled",
                    )
            except ProtocolError as error:
                if not error.stream_id:
                    raise
                self._stream_error(error)
            if self.closed_reason is not None and not self.streams:
                return
        self._pending = data[offset:] if offset < end else b""

    def _unopened(self, stream_id: int, name: str) -> ProtocolError | None:
        """A frame on a stream the client never opened (§5.1: idle), or ``None``."""
        if stream_id < self._next_stream_id and stream_id & 1:
            return None  # a call the client ended already
        return ProtocolError(
            Violation.MALFORMED,
            ErrorCode.PROTOCOL_ERROR,
            f"sent {name} on stream {stream_id}, which the client never opened",
        )

    def _on_data(self, stream_id: int, flags: int, payload: bytes) -> None:
        length = len(payload)
        if length > self._receive_window:
            raise ProtocolError(
                Violation.FLOW_CONTROL,
                ErrorCode.FLOW_CONTROL_ERROR,
                f"sent {length} bytes of DATA with {self._receive_window} left in the "
                f"connection's window",
            )
        self._receive_window -= length
        if self._receive_window < frames.MAX_WINDOW // 2:
            self._out.append(frames.window_update(0, frames.MAX_WINDOW - self._receive_window))
            self._receive_window = frames.MAX_WINDOW
        if flags & Flag.PADDED:
            start, stop = rules.unpadded(FrameType.DATA, flags, payload)
            payload = payload[start:stop]
        stream = self.streams.get(stream_id)
        if stream is None:
            error = self._unopened(stream_id, "DATA")
            if error is not None:
                raise error
            return
        if length > stream.receive_window:
            raise ProtocolError(
                Violation.FLOW_CONTROL,
                ErrorCode.FLOW_CONTROL_ERROR,
                f"sent {length} bytes of DATA on stream {stream_id} with "
                f"{stream.receive_window} left in its window",
                stream_id=stream_id,
            )
        stream.receive_window -= length
        # A message over several frames gathers in a bytearray; whole ones are cut from the frame.
        buffer: bytes | bytearray = stream.buffer
        if buffer:
            buffer += payload
        else:
            buffer = payload
        position, size_now, queued, appended = 0, len(buffer), 0, 0
        while size_now - position >= frames.MESSAGE_PREFIX_BYTES:
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
            end = position + frames.MESSAGE_PREFIX_BYTES + size
            if end > size_now:
                break
            if not stream.streaming and stream.messages:
                self._reset(
                    stream,
                    grpc.StatusCode.INTERNAL,
                    f"a unary answer from {self.target} had 2 messages",
                )
                return
            stream.messages.append(bytes(buffer[position + frames.MESSAGE_PREFIX_BYTES : end]))
            queued += size
            appended += 1
            position = end
        if position == size_now:
            stream.buffer = b""
        elif position or not isinstance(buffer, bytearray):
            stream.buffer = bytearray(buffer[position:])
        else:
            stream.buffer = buffer
        if flags & Flag.END_STREAM:
            self._finish(
                stream, grpc.StatusCode.INTERNAL, "the server ended the stream without trailers"
            )
            return
        # Bytes read are given back at once but for complete messages of a streaming call,
        # which count as read when the consumer takes them (consumed).
        stream.credit += length
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
            if stream.credit >= _CREDIT_BATCH and stream.queued_bytes <= _QUEUE_LOW:
                self._give_credit(stream)
        elif stream.credit >= _CREDIT_BATCH:
            self._give_credit(stream)

    def _on_headers(self, stream_id: int, flags: int, payload: bytes) -> None:
        start, end = rules.unpadded(FrameType.HEADERS, flags, payload)
        block = payload[start:end]
        if flags & Flag.END_HEADERS:
            self._on_header_block(stream_id, flags, block)
        else:
            self._header_block = (stream_id, flags, bytearray(block))
            self._header_charge = frames.FRAME_HEADER_BYTES + len(block)
            self._continuations = 0

    def _on_continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        header_block = self._header_block
        if header_block is None or header_block[0] != stream_id:
            raise ProtocolError(
                Violation.MALFORMED,
                ErrorCode.PROTOCOL_ERROR,
                f"sent a CONTINUATION on stream {stream_id} without its HEADERS",
            )
        gathered = header_block[2]
        # Each frame is charged its header besides its payload, as nghttp2 and h2 bound a block
        # by its frames: an endless run of empty CONTINUATIONs reaches the bound as a large
        # block does (about 7,300 of them), rather than burning CPU until keepalive.
        self._header_charge += frames.FRAME_HEADER_BYTES + len(payload)
        self._continuations += 1
        if self._header_charge > frames.MAX_HEADER_LIST_SIZE:
            # Left undecoded, the block leaves the server's HPACK table behind: the connection
            # cannot go on (§4.3), and no more of it is held.
            self._header_block = None
            message = (
                f"sent a header block of over {frames.MAX_HEADER_LIST_SIZE} bytes on stream "
                f"{stream_id} (HEADERS and {self._continuations} CONTINUATION frames, "
                f"{len(gathered) + len(payload)} bytes of fields, each frame's 9-byte header "
                f"counted), over the SETTINGS_MAX_HEADER_LIST_SIZE the client advertised"
            )
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._reset(
                    stream,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.target} {message}; the connection was closed",
                )
            raise ProtocolError(Violation.HEADER_LIST_SIZE, ErrorCode.COMPRESSION_ERROR, message)
        gathered.extend(payload)
        if flags & Flag.END_HEADERS:
            self._header_block = None
            self._on_header_block(stream_id, header_block[1], bytes(gathered))

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        stream = self.streams.get(stream_id)
        try:
            # Decoded for every stream, ended ones too: the decoder's table follows the server's.
            fields = self._decoder.decode(block)
        except HPACKDecodingError as exc:
            raise ProtocolError(
                Violation.COMPRESSION,
                ErrorCode.COMPRESSION_ERROR,
                f"sent a header block HPACK cannot decode ({exc})",
            ) from None
        except HeaderListTooLarge as exc:
            self._events.append(Breach(Violation.HEADER_LIST_SIZE))
            if stream is not None:
                self._reset(
                    stream,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.target} sent {exc} (SETTINGS_MAX_HEADER_LIST_SIZE) on stream "
                    f"{stream_id}",
                )
            return
        if stream is None:
            error = self._unopened(stream_id, "HEADERS")
            if error is not None:
                raise error
            return
        ended = bool(flags & Flag.END_STREAM)
        if not stream.headers_seen:
            stream.headers_seen = True
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
                        f"{self.target} sent a malformed :status {_shown(status)} (not 3 ASCII "
                        f"digits)",
                        ErrorCode.PROTOCOL_ERROR,
                    )
                    return
                self._refuse_answer(
                    stream,
                    ended,
                    frames.status_of_http(number or 0),
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
            if not ended:
                return
        self._on_trailers(stream, fields)

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

    def _on_trailers(self, stream: Stream, fields: Fields) -> None:
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
                code = frames.STATUS_BY_NUMBER.get(number, grpc.StatusCode.UNKNOWN)
            elif name == "grpc-message":
                details = frames.grpc_message(value)
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

    def _on_reset(self, stream_id: int, payload: bytes) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            error = self._unopened(stream_id, "RST_STREAM")
            if error is not None:
                raise error
            return
        (code,) = struct.unpack(">L", payload)
        name = rules.error_name(code)
        details = f"stream reset by {self.target} with {name} (HTTP/2 error {code})"
        if code == ErrorCode.REFUSED_STREAM:
            details += ": the server did not process the request"  # RFC 9113 §8.7
            if not stream.headers_seen:
                stream.unprocessed = "refused_stream"
        self._finish(stream, frames.status_of_reset(code), details)

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if flags & Flag.ACK:
            self._events.append(_SETTINGS_ACKNOWLEDGED)
            return
        if not self.settled:
            self.settled = True
            self._events.append(_SETTLED)
        opened = False
        for key, value in rules.settings(payload):
            if key == Setting.INITIAL_WINDOW_SIZE:
                delta = value - self._peer_initial_window
                if any(
                    stream.send_window + delta > frames.MAX_WINDOW
                    for stream in self.streams.values()
                ):
                    raise ProtocolError(
                        Violation.WINDOW_OVERFLOW,
                        ErrorCode.FLOW_CONTROL_ERROR,
                        f"sent SETTINGS_INITIAL_WINDOW_SIZE {value}, taking a stream's window "
                        f"past 2^31-1",
                    )
                self._peer_initial_window = value
                for stream in self.streams.values():
                    stream.send_window += delta
                opened = opened or delta > 0
            elif key == Setting.MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif key == Setting.MAX_CONCURRENT_STREAMS:
                self.peer_max_streams = value
                self._events.append(_SLOTS_CHANGED)
        self._reply(frames.SETTINGS_ACK)
        if opened and self._blocked:
            self._send_blocked()

    def _on_ping(self, flags: int, payload: bytes) -> None:
        if not flags & Flag.ACK:
            self._reply(frames.ping(payload, ack=True))
        else:
            self._events.append(_PING_ACKNOWLEDGED)

    def _reply(self, answer: bytes) -> None:
        """Queue a SETTINGS ACK or PING answer, within :data:`MAX_UNWRITTEN_REPLIES`."""
        self._unwritten_replies += 1
        if self._unwritten_replies > MAX_UNWRITTEN_REPLIES:
            raise ProtocolError(
                Violation.FLOOD,
                ErrorCode.ENHANCE_YOUR_CALM,
                f"sent over {MAX_UNWRITTEN_REPLIES} PINGs and SETTINGS before it took their "
                f"answers (a flood, or it does not read)",
            )
        self._out.append(answer)

    def _on_goaway(self, payload: bytes) -> None:
        last_stream_id, error = rules.goaway(payload)
        self.going_away = True
        reason = f"{self.target} sent GOAWAY with {rules.error_name(error)} (HTTP/2 error {error})"
        self.goaway_reason = reason
        for stream_id, stream in list(self.streams.items()):
            if stream_id > last_stream_id:
                if not stream.headers_seen:
                    stream.unprocessed = "goaway"
                self._finish(
                    stream,
                    grpc.StatusCode.UNAVAILABLE,
                    f"{reason}; the server did not process the request",
                )
        self._events.append(_SLOTS_CHANGED)

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            self._send_window += rules.window_increment(0, payload, self._send_window)
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                error = self._unopened(stream_id, "WINDOW_UPDATE")
                if error is not None:
                    raise error
                return  # a call the client ended: its window is nobody's
            stream.send_window += rules.window_increment(stream_id, payload, stream.send_window)
        if self._blocked:
            self._send_blocked()


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
