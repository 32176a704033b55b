"""One HTTP/2 connection carrying gRPC calls: an :class:`asyncio.Protocol` on the event loop.

Above it: :class:`~services.serving.h2grpc.channel.H2GrpcChannel`, which opens connections,
starts calls and reads their messages. Below it: the loop's transport (TCP, or TLS with ALPN
``h2``). What never crosses: frames. Callers see :class:`Call` objects (messages, then a status)
and :class:`~services.serving.h2grpc.errors.CallFailed`.

The protocol work is done where the bytes arrive, in :meth:`H2Connection.data_received`, with no
thread and no task of its own: receive flow control (the client's windows are opened to the
maximum at once and topped up as data arrives), send flow control (a request larger than the
server's windows waits for WINDOW_UPDATE), SETTINGS, PING answers, keepalive pings (a missing
answer closes the connection, failing its calls UNAVAILABLE, as gRPC's keepalive does), GOAWAY
(calls the server did not take fail UNAVAILABLE; no new call is started here), RST_STREAM, the
server's MAX_CONCURRENT_STREAMS (a call waits for a free stream) and the response's
headers, length-prefixed messages and trailers.

A server's breach of the protocol is handled as RFC 9113 §5.4 says, checked by
:mod:`~services.serving.h2grpc.rules`: a connection error sends GOAWAY with its error code, closes
the connection and fails its calls UNAVAILABLE with a message naming the breach; a stream error
sends RST_STREAM and fails that call INTERNAL. Bounds: a received frame over the advertised
SETTINGS_MAX_FRAME_SIZE (16 KiB, the default) is a FRAME_SIZE_ERROR before its payload is read, so
the bytes held for an unfinished frame stay under it; a header block over the advertised
SETTINGS_MAX_HEADER_LIST_SIZE (:data:`~services.serving.h2grpc.frames.MAX_HEADER_LIST_SIZE`) fails
its call RESOURCE_EXHAUSTED, and also closes the connection when it was still gathering
(CONTINUATION), since an abandoned block leaves HPACK's state behind (§4.3, COMPRESSION_ERROR). A
compressed message fails its call INTERNAL (the client asks for identity). Anything else that
goes wrong in :meth:`H2Connection.data_received` is logged and closes the connection
(INTERNAL_ERROR): nothing escapes into the event loop. Each breach is counted through the
``on_protocol_error`` callback (:class:`~services.serving.h2grpc.errors.Violation` labels).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import os
import struct
from collections.abc import Callable, Sequence
from typing import cast

import grpc
from hpack import HPACKDecodingError

from services.serving.h2grpc import frames, rules
from services.serving.h2grpc.call import Call
from services.serving.h2grpc.errors import CallFailed, Metadata, ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode, Flag, FrameType, Setting
from services.serving.h2grpc.hpack_decoder import Fields, HeaderListTooLarge, HpackDecoder

logger = logging.getLogger(__name__)

_RECEIVE_TOP_UP = 1 << 30
"""Received bytes after which a window (connection or stream) is opened again."""

_MAX_FRAME_RECEIVED = frames.DEFAULT_MAX_FRAME
"""The SETTINGS_MAX_FRAME_SIZE the client lives with (the default, so not sent)."""
_CLIENT_SETTINGS = frames.settings(
    {
        Setting.ENABLE_PUSH: 0,
        Setting.INITIAL_WINDOW_SIZE: frames.MAX_WINDOW,
        Setting.MAX_HEADER_LIST_SIZE: frames.MAX_HEADER_LIST_SIZE,
    }
) + frames.window_update(0, frames.MAX_WINDOW - frames.DEFAULT_WINDOW)

ProtocolErrorHook = Callable[[str], None]
"""Called with a :class:`~services.serving.h2grpc.errors.Violation` label for each breach."""


class H2Connection(asyncio.Protocol):
    """The client's end of one HTTP/2 connection (see the module docstring)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        target: str,
        *,
        authority: bytes,
        tls: bool,
        max_message_bytes: int,
        keepalive_s: float,
        keepalive_timeout_s: float,
        on_protocol_error: ProtocolErrorHook | None = None,
    ) -> None:
        self.loop = loop
        self.target = target
        self._authority = authority
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._on_protocol_error = on_protocol_error
        self._transport: asyncio.Transport | None = None
        self._out: list[bytes] = []
        self._decoder = HpackDecoder(frames.MAX_HEADER_LIST_SIZE)
        self._pending = b""
        self._header_block: tuple[int, int, bytearray] | None = None
        self._calls: dict[int, Call] = {}
        self._next_stream_id = 1
        self._prefixes: dict[bytes, bytes] = {}
        self._first_block = True
        self.peer_initial_window = frames.DEFAULT_WINDOW
        self._peer_max_frame = frames.DEFAULT_MAX_FRAME
        self._peer_max_streams = 2**31
        self._send_window = frames.DEFAULT_WINDOW
        self._received = 0
        self._window_waiters: list[asyncio.Future[None]] = []
        self._stream_waiters: list[asyncio.Future[None]] = []
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping_deadline: asyncio.TimerHandle | None = None
        self.closed_reason: str | None = None
        self.going_away = False
        self.settled: asyncio.Future[None] = loop.create_future()
        """Done when the server's first SETTINGS came (its limits known): calls start after."""

    # -- the connection's life ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        self._transport.write(frames.PREFACE + _CLIENT_SETTINGS)
        self._ping_timer = self.loop.call_later(self._keepalive_s, self._send_keepalive)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(
            self.closed_reason
            or (
                f"connection to {self.target} lost: {exc}"
                if exc
                else f"{self.target} closed the connection"
            )
        )

    def _closed(self, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE) -> None:
        """The connection is gone: its calls fail ``code`` with ``reason`` (idempotent)."""
        self.closed_reason = reason
        self._transport = None
        for timer in (self._ping_timer, self._ping_deadline):
            if timer is not None:
                timer.cancel()
        for call in list(self._calls.values()):
            self._finish(call, code, reason)
        self._wake_all(self._window_waiters)
        self._wake_all(self._stream_waiters)
        if not self.settled.done():
            self.settled.set_exception(CallFailed(code, reason))

    @property
    def is_open(self) -> bool:
        return self._transport is not None

    @property
    def usable(self) -> bool:
        """Whether a new call may start here (open, no GOAWAY, stream ids left)."""
        return (
            self._transport is not None and not self.going_away and self._next_stream_id < 2**31 - 1
        )

    def close(self, reason: str) -> None:
        if self._transport is not None:
            self.closed_reason = reason
            self._write(frames.goaway(0, ErrorCode.NO_ERROR))
            self._flush()
            self._transport.close()

    def _connection_error(
        self, error: ProtocolError, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    ) -> None:
        """RFC 9113 §5.4.1: GOAWAY with the error (last stream 0: the client accepts no stream
        of the server's), the connection closed, its calls failed ``code``."""
        reason = f"{self.target} {error}"
        logger.warning("HTTP/2 connection to %s closed: %s", self.target, reason)
        self._count(error.violation)
        if self._transport is not None:
            self._write(frames.goaway(0, error.code, error.message.encode()[:256]))
            self._flush()
            self._transport.abort()
        self._closed(reason, code)

    def _stream_error(self, error: ProtocolError) -> None:
        """RFC 9113 §5.4.2: RST_STREAM with the error, that call failed INTERNAL."""
        self._count(error.violation)
        call = self._calls.get(error.stream_id)
        if call is not None:
            self._write(frames.rst_stream(call.stream_id, error.code))
            self._finish(call, grpc.StatusCode.INTERNAL, f"{self.target} {error}")

    def _count(self, violation: str) -> None:
        if self._on_protocol_error is not None:
            try:
                self._on_protocol_error(violation)
            except Exception:
                logger.exception("the h2grpc protocol-error hook failed")

    def _write(self, data: bytes) -> None:
        """Queue ``data``; what the calls of one loop iteration queue goes out in one write."""
        if self._transport is None:
            return
        self._out.append(data)
        if len(self._out) == 1:
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if self._transport is not None and out:
            self._transport.write(b"".join(out) if len(out) > 1 else out[0])

    # -- starting calls -----------------------------------------------------------------------

    async def start(
        self,
        path: bytes,
        payload: bytes,
        *,
        deadline: float | None,
        streaming: bool,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Call:
        """Send one call's request (headers and its single message) and return its
        :class:`Call`; raises :class:`CallFailed` UNAVAILABLE when the connection cannot take
        it. ``deadline`` is the loop's clock; the call is reset and fails DEADLINE_EXCEEDED
        when it comes."""
        # Encoded first: metadata_block's ValueError must leave no call behind.
        custom = frames.metadata_block(metadata) if metadata else b""
        while len(self._calls) >= self._peer_max_streams and self.usable:
            await self._wait_on(self._stream_waiters)
        if not self.usable:
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE,
                self.closed_reason or f"connection to {self.target} is going away",
            )
        stream_id = self._next_stream_id
        self._next_stream_id += 2
        call = Call(self, stream_id, streaming=streaming)
        self._calls[stream_id] = call
        block = self._prefixes.get(path)
        if block is None:
            block = frames.request_headers_prefix(path, self._authority, tls=self._tls)
            self._prefixes[path] = block
        if self._first_block:
            block = frames.TABLE_SIZE_ZERO + block
            self._first_block = False
        if deadline is not None:
            block += frames.timeout_field(deadline - self.loop.time())
            call.deadline = self.loop.call_at(deadline, self._deadline_passed, call)
        block += custom
        headers = frames.frame(FrameType.HEADERS, Flag.END_HEADERS, stream_id, block)
        body = frames.message(payload)
        size = len(body)
        if size <= self._peer_max_frame and size <= self._send_window and size <= call.send_window:
            self._send_window -= size
            call.send_window -= size
            self._write(headers + frames.frame(FrameType.DATA, Flag.END_STREAM, stream_id, body))
        else:
            self._write(headers)
            try:
                await self._send_body(call, body)
            except BaseException:
                call.cancel()  # a caller that left mid-request leaves no half-sent stream
                raise
        return call

    async def _send_body(self, call: Call, body: bytes) -> None:
        """Send ``body`` in frames within the server's windows, waiting for WINDOW_UPDATEs."""
        view = memoryview(body)
        while view and call.code is None:
            room = min(self._peer_max_frame, self._send_window, call.send_window, len(view))
            if room <= 0:
                if self._transport is None:
                    return
                await self._wait_on(self._window_waiters)
                continue
            chunk, view = view[:room], view[room:]
            self._send_window -= room
            call.send_window -= room
            flags = Flag.END_STREAM if not view else 0
            self._write(frames.frame(FrameType.DATA, flags, call.stream_id, bytes(chunk)))

    async def _wait_on(self, waiters: list[asyncio.Future[None]]) -> None:
        waiter = self.loop.create_future()
        waiters.append(waiter)
        await waiter

    @staticmethod
    def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        waiters.clear()

    # -- ending calls ---------------------------------------------------------------------------

    def reset(self, call: Call, code: grpc.StatusCode, details: str) -> None:
        """End ``call`` from the client's side: RST_STREAM CANCEL, then the given status."""
        if call.code is None:
            self._write(frames.rst_stream(call.stream_id, ErrorCode.CANCEL))
            self._finish(call, code, details)

    def _deadline_passed(self, call: Call) -> None:
        call.deadline = None
        self.reset(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    def _finish(
        self, call: Call, code: grpc.StatusCode, details: str, metadata: Metadata = ()
    ) -> None:
        if call.code is not None:
            return
        call.code, call.details, call.metadata = code, details, metadata
        if call.deadline is not None:
            call.deadline.cancel()
            call.deadline = None
        self._calls.pop(call.stream_id, None)
        call.wake()
        if self._stream_waiters:
            self._wake_all(self._stream_waiters)
        if self.going_away and not self._calls:
            self.close("GOAWAY: every call finished")

    # -- receiving ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
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
            if self._transport is None:
                return
        self._pending = data[offset:] if offset < end else b""

    @property
    def header_block_bytes(self) -> int:
        """The bytes of a header block gathered so far (HEADERS then CONTINUATIONs)."""
        return len(self._header_block[2]) if self._header_block is not None else 0

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
        self._received += length
        if self._received >= _RECEIVE_TOP_UP:
            self._write(frames.window_update(0, self._received))
            self._received = 0
        if flags & Flag.PADDED:
            start, stop = rules.unpadded(FrameType.DATA, flags, payload)
            payload = payload[start:stop]
        call = self._calls.get(stream_id)
        if call is None:
            error = self._unopened(stream_id, "DATA")
            if error is not None:
                raise error
            return
        call.received += length
        if call.received >= _RECEIVE_TOP_UP and not flags & Flag.END_STREAM:
            self._write(frames.window_update(stream_id, call.received))
            call.received = 0
        # A message over several frames gathers in a bytearray; whole ones are cut from the frame.
        buffer: bytes | bytearray = call.buffer
        if buffer:
            buffer += payload
        else:
            buffer = payload
        position, size_now, got = 0, len(buffer), False
        while size_now - position >= frames.MESSAGE_PREFIX_BYTES:
            compressed, size = struct.unpack_from(">BL", buffer, position)
            if compressed:
                self._count(Violation.COMPRESSED_MESSAGE)
                self.reset(
                    call,
                    grpc.StatusCode.INTERNAL,
                    f"compressed gRPC messages are not supported ({self.target} sent one, "
                    f"grpc-encoding {call.encoding or '(none)'}, to a client that accepts "
                    f"identity only)",
                )
                return
            if size > self._max_message_bytes:
                self.reset(
                    call,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"received message larger than max ({size} vs. {self._max_message_bytes})",
                )
                return
            end = position + frames.MESSAGE_PREFIX_BYTES + size
            if end > size_now:
                break
            call.messages.append(bytes(buffer[position + frames.MESSAGE_PREFIX_BYTES : end]))
            position, got = end, True
        if position == size_now:
            call.buffer = b""
        elif position or not isinstance(buffer, bytearray):
            call.buffer = bytearray(buffer[position:])
        else:
            call.buffer = buffer
        if flags & Flag.END_STREAM:
            self._finish(
                call, grpc.StatusCode.INTERNAL, "the server ended the stream without trailers"
            )
        elif got and call.streaming:
            call.wake()

    def _on_headers(self, stream_id: int, flags: int, payload: bytes) -> None:
        start, end = rules.unpadded(FrameType.HEADERS, flags, payload)
        block = payload[start:end]
        if flags & Flag.END_HEADERS:
            self._on_header_block(stream_id, flags, block)
        else:
            self._header_block = (stream_id, flags, bytearray(block))

    def _on_continuation(self, stream_id: int, flags: int, payload: bytes) -> None:
        header_block = self._header_block
        if header_block is None or header_block[0] != stream_id:
            raise ProtocolError(
                Violation.MALFORMED,
                ErrorCode.PROTOCOL_ERROR,
                f"sent a CONTINUATION on stream {stream_id} without its HEADERS",
            )
        gathered = header_block[2]
        if len(gathered) + len(payload) > frames.MAX_HEADER_LIST_SIZE:
            # Left undecoded, the block leaves the server's HPACK table behind: the connection
            # cannot go on (§4.3), and no more of it is held.
            self._header_block = None
            message = (
                f"sent a header block of over {frames.MAX_HEADER_LIST_SIZE} bytes on stream "
                f"{stream_id} (HEADERS and CONTINUATION), over the SETTINGS_MAX_HEADER_LIST_SIZE "
                f"the client advertised"
            )
            call = self._calls.get(stream_id)
            if call is not None:
                self.reset(
                    call,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.target} {message}; the connection was closed",
                )
            raise ProtocolError(Violation.HEADER_LIST_SIZE, ErrorCode.COMPRESSION_ERROR, message)
        gathered.extend(payload)
        if flags & Flag.END_HEADERS:
            self._header_block = None
            self._on_header_block(stream_id, header_block[1], bytes(gathered))

    def _on_header_block(self, stream_id: int, flags: int, block: bytes) -> None:
        call = self._calls.get(stream_id)
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
            self._count(Violation.HEADER_LIST_SIZE)
            if call is not None:
                self.reset(
                    call,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{self.target} sent {exc} (SETTINGS_MAX_HEADER_LIST_SIZE) on stream "
                    f"{stream_id}",
                )
            return
        if call is None:
            error = self._unopened(stream_id, "HEADERS")
            if error is not None:
                raise error
            return
        ended = bool(flags & Flag.END_STREAM)
        if not call.headers_seen:
            call.headers_seen = True
            status = ""
            for name, value in fields:
                if name == ":status":
                    status = value
                elif name == "grpc-encoding":
                    call.encoding = value
            if status != "200":
                self._finish(
                    call,
                    frames.status_of_http(int(status) if status.isdigit() else 0),
                    f"HTTP status {status or 'missing'} from {self.target} (not a gRPC answer)",
                )
                return
            if not ended:
                return
        self._on_trailers(call, fields)

    def _on_trailers(self, call: Call, fields: Fields) -> None:
        code: grpc.StatusCode | None = None
        details = ""
        metadata: list[tuple[str, str | bytes]] = []
        for name, value in fields:
            if name == "grpc-status":
                code = frames.STATUS_BY_NUMBER.get(int(value) if value.isdigit() else -1)
                if code is None:
                    code = grpc.StatusCode.UNKNOWN
            elif name == "grpc-message":
                details = frames.grpc_message(value)
            elif name.endswith("-bin"):
                try:
                    metadata.append((name, base64.b64decode(value + "==")))
                except binascii.Error:
                    self._count(Violation.MALFORMED)
                    self._finish(
                        call,
                        grpc.StatusCode.INTERNAL,
                        f"{self.target} sent binary metadata {name} that is not base64",
                    )
                    return
            elif not name.startswith((":", "grpc-")) and name != "content-type":
                metadata.append((name, value))
        if code is None:
            code, details = grpc.StatusCode.UNKNOWN, "the server's trailers carry no grpc-status"
        elif code is grpc.StatusCode.OK and call.buffer:
            code, details = grpc.StatusCode.INTERNAL, "the stream ended inside a message"
        self._finish(call, code, details, tuple(metadata))

    def _on_reset(self, stream_id: int, payload: bytes) -> None:
        call = self._calls.get(stream_id)
        if call is None:
            error = self._unopened(stream_id, "RST_STREAM")
            if error is not None:
                raise error
            return
        (code,) = struct.unpack(">L", payload)
        name = rules.error_name(code)
        details = f"stream reset by {self.target} with {name} (HTTP/2 error {code})"
        if code == ErrorCode.REFUSED_STREAM:
            details += ": the server did not process the request"  # RFC 9113 §8.7
        self._finish(call, frames.status_of_reset(code), details)

    def _on_settings(self, flags: int, payload: bytes) -> None:
        if flags & Flag.ACK:
            return
        if not self.settled.done():
            self.settled.set_result(None)
        for key, value in rules.settings(payload):
            if key == Setting.INITIAL_WINDOW_SIZE:
                delta = value - self.peer_initial_window
                if any(
                    call.send_window + delta > frames.MAX_WINDOW for call in self._calls.values()
                ):
                    raise ProtocolError(
                        Violation.WINDOW_OVERFLOW,
                        ErrorCode.FLOW_CONTROL_ERROR,
                        f"sent SETTINGS_INITIAL_WINDOW_SIZE {value}, taking a stream's window "
                        f"past 2^31-1",
                    )
                self.peer_initial_window = value
                for call in self._calls.values():
                    call.send_window += delta
                if delta > 0:
                    self._wake_all(self._window_waiters)
            elif key == Setting.MAX_FRAME_SIZE:
                self._peer_max_frame = value
            elif key == Setting.MAX_CONCURRENT_STREAMS:
                self._peer_max_streams = value
                self._wake_all(self._stream_waiters)
        self._write(frames.SETTINGS_ACK)

    def _on_ping(self, flags: int, payload: bytes) -> None:
        if not flags & Flag.ACK:
            self._write(frames.ping(payload, ack=True))
        elif self._ping_deadline is not None:
            self._ping_deadline.cancel()
            self._ping_deadline = None
            self._ping_timer = self.loop.call_later(self._keepalive_s, self._send_keepalive)

    def _on_goaway(self, payload: bytes) -> None:
        last_stream_id, error = rules.goaway(payload)
        self.going_away = True
        self.closed_reason = (
            f"{self.target} sent GOAWAY with {rules.error_name(error)} (HTTP/2 error {error})"
        )
        for stream_id, call in list(self._calls.items()):
            if stream_id > last_stream_id:
                self._finish(call, grpc.StatusCode.UNAVAILABLE, self.closed_reason)
        self._wake_all(self._stream_waiters)
        if not self._calls and self._transport is not None:
            self._transport.close()

    def _on_window_update(self, stream_id: int, payload: bytes) -> None:
        if stream_id == 0:
            self._send_window += rules.window_increment(0, payload, self._send_window)
        else:
            call = self._calls.get(stream_id)
            if call is None:
                error = self._unopened(stream_id, "WINDOW_UPDATE")
                if error is not None:
                    raise error
                return  # a call the client ended: its window is nobody's
            call.send_window += rules.window_increment(stream_id, payload, call.send_window)
        if self._window_waiters:
            self._wake_all(self._window_waiters)

    # -- keepalive ----------------------------------------------------------------------------

    def _send_keepalive(self) -> None:
        self._ping_timer = None
        if self._transport is None:
            return
        self._write(frames.ping(os.urandom(8)))
        self._ping_deadline = self.loop.call_later(self._keepalive_timeout_s, self._keepalive_lost)

    def _keepalive_lost(self) -> None:
        self._ping_deadline = None
        if self._transport is None:
            return
        reason = (
            f"{self.target} did not answer a keepalive ping within {self._keepalive_timeout_s:g} s"
        )
        logger.warning("%s: closing the connection", reason)
        self.closed_reason = reason
        self._transport.abort()
