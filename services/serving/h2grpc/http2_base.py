"""One HTTP/2 connection's client-side state and what the client does with it, sans I/O: the
base of :class:`~services.serving.h2grpc.http2.H2ClientConnection`, with a stream's state
(:class:`H2Stream`, which the protocol's calls extend) and why the connection ended one
(:class:`StreamEnd`, which the protocol maps to its own outcome).

Where it cuts. :class:`H2ConnectionBase` keeps what the connection knows (its streams, the
server's settings and windows, whether it is going away or closed, the bytes queued for the
server) and does what the client asks: start a stream with a header block and a body (within the
server's windows), open a stream's receive window again, reset and close a stream, ping, close,
and end every stream when the connection fails. Beside it, the subclass in
:mod:`~services.serving.h2grpc.http2` reads the server's frames and changes this state. Above:
the protocol on the streams (:mod:`~services.serving.h2grpc.protocol`, gRPC), which implements
the hooks declared here (:mod:`~services.serving.h2grpc.http2` says what crosses). Below: frames
as bytes (:mod:`~services.serving.h2grpc.frames`). No I/O, no clock, nothing of gRPC.
"""

from __future__ import annotations

import abc
import logging
from typing import Generic, TypeVar

from services.serving.h2grpc import frames
from services.serving.h2grpc.errors import ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode, Flag, FrameType, Setting
from services.serving.h2grpc.hpack_decoder import Fields
from services.serving.h2grpc.http2_events import SLOTS_CHANGED, Breach, ConnectionEnded, Event

logger = logging.getLogger(__name__)

STREAM_WINDOW = 1 << 20
"""Each stream's receive window (SETTINGS_INITIAL_WINDOW_SIZE): what a call may have in flight
from the server beyond what its consumer has read. grpclib uses 4 MiB, grpc-core starts at 64 KiB
and grows it by its BDP estimate; pdserve's engines stream small messages (a few tokens each), so
1 MiB never stalls a stream that is read, and bounds one that is not."""


class H2Stream:
    """One stream's HTTP/2 state. ``closed`` once it ended (the layer above closed it);
    ``unprocessed``: why the server never processed it, when it ended so (``"refused_stream"``:
    REFUSED_STREAM before an answer; ``"goaway"``: above a GOAWAY's last stream id), else ``""``:
    such a request may be sent again. The others: ``headers_seen`` (the response's headers came),
    ``send_window``, ``unsent`` (body bytes waiting for it), ``receive_window`` and ``credit``
    (bytes received but not yet given back to the server)."""

    __slots__ = (
        "closed",
        "credit",
        "headers_seen",
        "receive_window",
        "send_window",
        "stream_id",
        "unprocessed",
        "unsent",
    )

    def __init__(self) -> None:
        self.stream_id = 0
        self.closed = False
        self.unprocessed = ""
        self.headers_seen = False
        self.send_window = 0
        self.unsent: memoryview | None = None
        self.receive_window = STREAM_WINDOW
        self.credit = 0

    @property
    def held_bytes(self) -> int:
        """The body bytes not yet sent."""
        return len(self.unsent) if self.unsent is not None else 0


class StreamEnd:
    """Why the connection ended a stream (its ``_stream_ended`` hook); the layer above maps
    each to its own outcome."""

    RESET = "reset"
    """The server's RST_STREAM (its error code given)."""
    GOAWAY = "goaway"
    """Above a GOAWAY's last stream id: the server did not process it."""
    CONNECTION = "connection"
    """A connection error, the connection's loss or its close."""
    INTERNAL = "internal"
    """The client failed on what it received (a bug of its own, logged)."""
    STREAM_ERROR = "stream_error"
    """The server broke a rule on this stream (RFC 9113 §5.4.2): RST_STREAM sent."""
    HEADER_LIST_SIZE = "header_list_size"
    """A header block over the SETTINGS_MAX_HEADER_LIST_SIZE the client advertised."""


CREDIT_BATCH = STREAM_WINDOW // 4
"""Bytes read before a stream's window is opened again (one WINDOW_UPDATE per batch). Below it
:meth:`H2ConnectionBase._open_window` sends nothing, so the layer above checks ``stream.credit``
against it before the call: the one shortcut on the hot path (a message a frame)."""
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

S = TypeVar("S", bound=H2Stream)


class H2ConnectionBase(abc.ABC, Generic[S]):
    """One HTTP/2 connection's client-side state, over streams of type ``S`` (see the module
    docstring); ``target`` names the server in every message. The layer above implements the
    hooks (``_response_received``, ``_data_received``, ``_trailers_received``,
    ``_stream_ended``), which the subclass calls as the server's frames come."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._out: list[bytes] = [frames.PREFACE + _CLIENT_SETTINGS]
        self._events: list[Event] = []
        self._unwritten_replies = 0
        self.streams: dict[int, S] = {}
        """The open streams by id."""
        self._next_stream_id = 1
        self._first_block = True
        self._peer_initial_window = frames.DEFAULT_WINDOW
        self._peer_max_frame = frames.DEFAULT_MAX_FRAME
        self.peer_max_streams = 2**31
        self._send_window = frames.DEFAULT_WINDOW
        self._receive_window = frames.MAX_WINDOW
        self._blocked: list[S] = []
        self.settled = False
        self.going_away = False
        self.goaway_reason: str | None = None
        """What the server's GOAWAY said, once one came."""
        self.closed_reason: str | None = None
        """Why the connection is closing or closed; ``None`` while it is usable."""

    # -- the layer above's hooks: a stream's events -----------------------------------------

    @abc.abstractmethod
    def _response_received(self, stream: S, fields: Fields, ended: bool) -> None:
        """The response's header fields came on ``stream`` (``ended``: END_STREAM with them)."""

    @abc.abstractmethod
    def _data_received(self, stream: S, data: bytes, ended: bool) -> None:
        """DATA came on ``stream`` (its padding removed; ``ended``: END_STREAM). Its bytes
        count against the stream's window until the layer calls :meth:`_open_window`."""

    @abc.abstractmethod
    def _trailers_received(self, stream: S, fields: Fields) -> None:
        """A header block after the response's headers came on ``stream``."""

    @abc.abstractmethod
    def _stream_ended(self, stream: S, why: str, details: str, error: int) -> None:
        """This layer ended ``stream`` (``why``: a :class:`StreamEnd`; ``details`` names what
        happened; ``error``: the RST_STREAM's HTTP/2 error code, the server's for
        :attr:`StreamEnd.RESET`, 0 where none was sent). The layer above records its outcome
        and calls :meth:`_close_stream` (a stream it closed already it leaves alone)."""

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

    def _start_stream(self, stream: S, block: bytes, body: bytes) -> None:
        """Start ``stream``: HEADERS with ``block`` (an encoded header block that fits one
        frame), then ``body`` with END_STREAM, as much as the server's windows take now, the
        rest as they open. The caller checked :attr:`usable`."""
        assert self.usable
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        stream.stream_id = stream_id
        stream.send_window = self._peer_initial_window
        self.streams[stream_id] = stream
        if self._first_block:
            block = frames.TABLE_SIZE_ZERO + block
            self._first_block = False
        headers = frames.frame(FrameType.HEADERS, Flag.END_HEADERS, stream_id, block)
        size = len(body)
        if (
            size <= self._send_window
            and size <= stream.send_window
            and size <= self._peer_max_frame
        ):
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

    def _send_unsent(self, stream: S) -> None:
        """As much of ``stream``'s body as the windows take."""
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
        """The bodies that wait for windows, after a window opened."""
        for stream in self._blocked:
            if not stream.closed:
                self._send_unsent(stream)
        self._blocked = [s for s in self._blocked if s.unsent is not None and not s.closed]

    def _open_window(self, stream: S) -> None:
        """The layer above's reader has room on ``stream``: what arrived on it is given back to
        the server, one WINDOW_UPDATE per :data:`CREDIT_BATCH` bytes."""
        if stream.credit >= CREDIT_BATCH:
            self._out.append(frames.window_update(stream.stream_id, stream.credit))
            stream.receive_window += stream.credit
            stream.credit = 0

    def _send_reset(self, stream: S, error: ErrorCode) -> None:
        """Queue RST_STREAM ``error`` for ``stream`` (the caller then ends it)."""
        self._out.append(frames.rst_stream(stream.stream_id, error))

    def _close_stream(self, stream: S) -> None:
        """``stream`` ended: it leaves the connection (its unsent body is dropped)."""
        stream.closed = True
        stream.unsent = None
        at_limit = len(self.streams) >= self.peer_max_streams
        self.streams.pop(stream.stream_id, None)
        if at_limit:
            self._events.append(SLOTS_CHANGED)

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
        """The transport is gone: every stream ends with ``reason`` (or the reason the
        connection was closing for)."""
        self._end_all(self.closed_reason or reason, StreamEnd.CONNECTION)
        return self._take_events()

    # -- ending streams -------------------------------------------------------------------------

    def _abort(self, stream: S, why: str, details: str, error: ErrorCode) -> None:
        """End ``stream`` from this layer: RST_STREAM ``error``, then :meth:`_stream_ended`."""
        if not stream.closed:
            self._send_reset(stream, error)
            self._stream_ended(stream, why, details, error)

    def _end_all(self, reason: str, why: str) -> None:
        self.closed_reason = reason
        for stream in list(self.streams.values()):
            self._stream_ended(stream, why, reason, 0)
        self._events.append(SLOTS_CHANGED)

    def _connection_error(self, error: ProtocolError, why: str = StreamEnd.CONNECTION) -> None:
        """RFC 9113 §5.4.1: GOAWAY with the error (last stream 0: the client accepts no stream
        of the server's), every stream ended."""
        if self.closed_reason is not None and not self.streams:
            return  # already ended
        reason = f"{self.target} {error}"
        logger.warning("HTTP/2 connection to %s closed: %s", self.target, reason)
        self._events.append(Breach(error.violation))
        self._out.append(frames.goaway(0, error.code, error.message.encode()[:256]))
        self._end_all(reason, why)
        self._events.append(ConnectionEnded(reason))

    def _stream_error(self, error: ProtocolError) -> None:
        """RFC 9113 §5.4.2: RST_STREAM with the error, that stream ended."""
        self._events.append(Breach(error.violation))
        stream = self.streams.get(error.stream_id)
        if stream is not None:
            self._abort(stream, StreamEnd.STREAM_ERROR, f"{self.target} {error}", error.code)

    def _take_events(self) -> list[Event]:
        events, self._events = self._events, []
        return events

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
