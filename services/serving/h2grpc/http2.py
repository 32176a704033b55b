"""The client's end of one HTTP/2 connection, sans I/O: bytes in, stream events up, frames out.

:class:`H2ClientConnection` reads the server's frames and acts on them; its base,
:class:`~services.serving.h2grpc.http2_base.H2ConnectionBase`, holds the connection's state and
does what the client asks (start a stream, open a window, reset, close).

Where it cuts. Below: bytes. :meth:`H2ClientConnection.receive` takes what the server sent and
returns the connection's events (:mod:`~services.serving.h2grpc.http2_events`); what it queues
(a request, a reset, a WINDOW_UPDATE, a PING's answer) waits for ``data_to_send``. No I/O, no
event loop, no clock: the asyncio layer (:mod:`~services.serving.h2grpc.connection`) moves the
bytes and keeps the timers. Above: the protocol that carries calls on the streams,
:mod:`~services.serving.h2grpc.protocol` (gRPC), a subclass. It starts a stream with a header
block and a body it encoded (``_start_stream``) and gets each stream's events through the hooks
the base declares, h2's stream events as method calls: a response's headers, its DATA, its
trailers, and the end of a stream this layer decided (the server's RST_STREAM, a GOAWAY, a
breach, the connection's loss: a :class:`~services.serving.h2grpc.http2_base.StreamEnd`). It
records the stream's outcome and closes it (``_close_stream``), and says when its reader has
room so the stream's window opens (``_open_window``). What never crosses: HTTP/2 reads no DATA
payload and no header value (no ``grpc-status``, no message prefix, no content-type); the layer
above writes no frame but through the base's methods and keeps no window. Hooks rather than
event objects (h2 returns objects): a streamed message is a DATA frame, and an object per frame
costs the router's hot path.

What it does: the preface and SETTINGS (the server's limits: concurrent streams, frame size,
initial window), PING answers, GOAWAY (streams above its last stream id end ``unprocessed``:
safe to retry elsewhere; no new stream starts), RST_STREAM (REFUSED_STREAM before any answer is
also ``unprocessed``, RFC 9113 §8.7), header blocks
(:mod:`~services.serving.h2grpc.header_blocks`). Flow control, both ways: a body larger than the
server's windows is sent as WINDOW_UPDATEs open them; each stream's receive window
(:data:`~services.serving.h2grpc.http2_base.STREAM_WINDOW`) is given back when the layer above
says its reader has room, not as bytes arrive: the backpressure from a slow reader to the
server. The connection's window is opened to the maximum and topped up as data arrives: the
streams' windows are the bound, so one slow stream never holds up the others.

A server's breach is handled as RFC 9113 §5.4 says, checked by
:mod:`~services.serving.h2grpc.rules`: a connection error queues GOAWAY with its error code, ends
every stream and returns :class:`~services.serving.h2grpc.http2_events.ConnectionEnded`; a
stream error queues RST_STREAM and ends that stream. DATA past a window the client opened is a
FLOW_CONTROL_ERROR (the connection's: a connection error; a stream's: a stream error). A frame
over the advertised SETTINGS_MAX_FRAME_SIZE (16 KiB, the default) is a FRAME_SIZE_ERROR before
its payload is read, so the bytes held for an unfinished frame stay under it. A header block over
the advertised SETTINGS_MAX_HEADER_LIST_SIZE ends its stream, and the connection too when it was
still gathering (HPACK's state is then behind, §4.3: COMPRESSION_ERROR). More than
:data:`~services.serving.h2grpc.http2_base.MAX_UNWRITTEN_REPLIES` answers to PINGs and SETTINGS
queued before the I/O layer says its writes drained (``written``) end the connection
ENHANCE_YOUR_CALM, and so do more than :data:`MAX_IDLE_FRAMES` frames in a row that carry
nothing (empty DATA, PRIORITY, unknown types).
Anything else that goes wrong while receiving, in this layer or the one above, is a connection
error INTERNAL_ERROR with the exception named: nothing escapes
:meth:`~H2ClientConnection.receive`. Each breach comes out as a
:class:`~services.serving.h2grpc.http2_events.Breach` event
(:class:`~services.serving.h2grpc.errors.Violation` labels).
"""

from __future__ import annotations

import logging
import struct

from hpack import HPACKDecodingError

from services.serving.h2grpc import frames, rules
from services.serving.h2grpc.errors import ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode, Flag, FrameType, Setting
from services.serving.h2grpc.header_blocks import BlockTooLarge, HeaderBlocks
from services.serving.h2grpc.hpack_decoder import HeaderListTooLarge, HpackDecoder
from services.serving.h2grpc.http2_base import H2ConnectionBase, S, StreamEnd
from services.serving.h2grpc.http2_events import (
    PING_ACKNOWLEDGED,
    SETTINGS_ACKNOWLEDGED,
    SETTLED,
    SLOTS_CHANGED,
    Breach,
    Event,
)

logger = logging.getLogger(__name__)

_MAX_FRAME_RECEIVED = frames.DEFAULT_MAX_FRAME
"""The SETTINGS_MAX_FRAME_SIZE the client lives with (the default, so not sent)."""

MAX_IDLE_FRAMES = 1000
"""Most frames in a row that carry nothing (PRIORITY, a type HTTP/2 does not define, DATA with
no payload that does not end its stream): each is legal alone, but a server that sends only
those costs the router CPU for no progress, so past this bound the connection ends
ENHANCE_YOUR_CALM. Netty allows 2 empty DATA frames in a row; any frame that carries something
(HEADERS, DATA with a payload or END_STREAM, SETTINGS, PING, WINDOW_UPDATE...) starts the count
again."""


class H2ClientConnection(H2ConnectionBase[S]):
    """One HTTP/2 connection's client side (see the module docstring): the server's frames
    read and acted on, over the state and the client's actions of
    :class:`~services.serving.h2grpc.http2_base.H2ConnectionBase`."""

    def __init__(self, target: str) -> None:
        super().__init__(target)
        self._decoder = HpackDecoder(frames.MAX_HEADER_LIST_SIZE)
        self._pending = b""
        self._blocks = HeaderBlocks()
        self._idle_frames = 0

    @property
    def held_bytes(self) -> int:
        """The bytes the connection holds: its streams' (``held_bytes``), an unfinished frame's,
        and a header block's gathered so far (HEADERS then CONTINUATIONs)."""
        held = len(self._pending) + sum(stream.held_bytes for stream in self.streams.values())
        return held + self._blocks.held_bytes

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
                StreamEnd.INTERNAL,
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
            if (
                kind == FrameType.PRIORITY
                or kind > FrameType.CONTINUATION
                or (kind == FrameType.DATA and not length and not flags & Flag.END_STREAM)
            ):
                self._idle_frame(kind)
            else:
                self._idle_frames = 0
            if self._blocks.stream_id and kind != FrameType.CONTINUATION:
                raise ProtocolError(
                    Violation.MALFORMED,
                    ErrorCode.PROTOCOL_ERROR,
                    f"interrupted the header block of stream {self._blocks.stream_id}",
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

    def _idle_frame(self, kind: int) -> None:
        """One more frame in a row that carries nothing; raises past :data:`MAX_IDLE_FRAMES`."""
        self._idle_frames += 1
        if self._idle_frames > MAX_IDLE_FRAMES:
            raise ProtocolError(
                Violation.FLOOD,
                ErrorCode.ENHANCE_YOUR_CALM,
                f"sent {self._idle_frames} frames in a row that carry nothing (the last of "
                f"type {kind}: empty DATA, PRIORITY or unknown types)",
            )

    def _unopened(self, stream_id: int, name: str) -> None:
        """A frame on a stream that is not open: raises unless the client opened it and ended it
        already (one it never opened is idle, §5.1)."""
        if stream_id < self._next_stream_id and stream_id & 1:
            return
        raise ProtocolError(
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
            self._unopened(stream_id, "DATA")
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
        stream.credit += length  # given back when the layer above says (_open_window)
        self._data_received(stream, payload, flags & Flag.END_STREAM != 0)

    def _on_headers(self, stream_id: int, flags: int, payload: bytes) -> None:
        start, end = rules.unpadded(FrameType.HEADERS, flags, payload)
        if flags & Flag.END_HEADERS:
            self._on_header_block(stream_id, flags, payload[start:end])
        else:
            self._blocks.start(stream_id, flags, payload[start:end])

    def _on_continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        try:
            done = self._blocks.continuation(stream_id, flags, payload)
        except BlockTooLarge as exc:
            # Left undecoded, the block leaves the server's HPACK table behind: the connection
            # cannot go on (§4.3).
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._abort(
                    stream,
                    StreamEnd.HEADER_LIST_SIZE,
                    f"{self.target} {exc.message}; the connection was closed",
                    ErrorCode.CANCEL,
                )
            raise ProtocolError(
                Violation.HEADER_LIST_SIZE, ErrorCode.COMPRESSION_ERROR, exc.message
            ) from None
        if done is not None:
            self._on_header_block(stream_id, *done)

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
                self._abort(
                    stream,
                    StreamEnd.HEADER_LIST_SIZE,
                    f"{self.target} sent {exc} (SETTINGS_MAX_HEADER_LIST_SIZE) on stream "
                    f"{stream_id}",
                    ErrorCode.CANCEL,
                )
            return
        if stream is None:
            self._unopened(stream_id, "HEADERS")
            return
        if not stream.headers_seen:
            stream.headers_seen = True
            self._response_received(stream, fields, flags & Flag.END_STREAM != 0)
        else:
            self._trailers_received(stream, fields)

    def _on_reset(self, stream_id: int, payload: bytes) -> None:
        stream = self.streams.get(stream_id)
        if stream is None:
            self._unopened(stream_id, "RST_STREAM")
            return
        (code,) = struct.unpack(">L", payload)
        name = rules.error_name(code)
        details = f"stream reset by {self.target} with {name} (HTTP/2 error {code})"
        if code == ErrorCode.REFUSED_STREAM:
            details += ": the server did not process the request"  # RFC 9113 §8.7
            if not stream.headers_seen:
                stream.unprocessed = "refused_stream"
        self._stream_ended(stream, StreamEnd.RESET, details, code)

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if flags & Flag.ACK:
            self._events.append(SETTINGS_ACKNOWLEDGED)
            return
        if not self.settled:
            self.settled = True
            self._events.append(SETTLED)
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
                self._events.append(SLOTS_CHANGED)
        self._reply(frames.SETTINGS_ACK)
        if opened and self._blocked:
            self._send_blocked()

    def _on_ping(self, flags: int, payload: bytes) -> None:
        if not flags & Flag.ACK:
            self._reply(frames.ping(payload, ack=True))
        else:
            self._events.append(PING_ACKNOWLEDGED)

    def _on_goaway(self, payload: bytes) -> None:
        last_stream_id, error = rules.goaway(payload)
        self.going_away = True
        reason = f"{self.target} sent GOAWAY with {rules.error_name(error)} (HTTP/2 error {error})"
        self.goaway_reason = reason
        for stream_id, stream in list(self.streams.items()):
            if stream_id > last_stream_id:
                if not stream.headers_seen:
                    stream.unprocessed = "goaway"
                self._stream_ended(
                    stream,
                    StreamEnd.GOAWAY,
                    f"{reason}; the server did not process the request",
                    0,
                )
        self._events.append(SLOTS_CHANGED)

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            self._send_window += rules.window_increment(0, payload, self._send_window)
        else:
            stream = self.streams.get(stream_id)
            if stream is None:
                self._unopened(stream_id, "WINDOW_UPDATE")
                return  # a stream the client ended: its window is nobody's
            stream.send_window += rules.window_increment(stream_id, payload, stream.send_window)
        if self._blocked:
            self._send_blocked()
