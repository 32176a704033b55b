"""One HTTP/2 connection carrying gRPC calls on the event loop: the asyncio transport around
:class:`~services.serving.h2grpc.protocol.ClientProtocol`.

Above it: :class:`~services.serving.h2grpc.channel.H2GrpcChannel`, which opens connections,
starts calls and reads their messages. Below it: the loop's transport (TCP, or TLS with ALPN
``h2``). The protocol (frames, HTTP/2 state, flow control, the rules a server must keep) is
sans-IO (:mod:`~services.serving.h2grpc.http2` for HTTP/2,
:mod:`~services.serving.h2grpc.protocol` for gRPC on it); :class:`H2Connection` only moves bytes
between it and the transport, turns its events
into wake-ups of the calls' waiters, and keeps what needs a clock:

- a call's deadline (its stream reset, the call failed DEADLINE_EXCEEDED), which also bounds its
  wait for a free stream (the server's MAX_CONCURRENT_STREAMS) and for the server's windows;
- keepalive pings (a missing answer closes the connection, failing its calls UNAVAILABLE, as
  gRPC's keepalive does);
- the SETTINGS-ACK timeout (RFC 9113 §6.5.3): a server that does not acknowledge the client's
  SETTINGS in time gets GOAWAY SETTINGS_TIMEOUT, and its calls fail UNAVAILABLE.

Writer backpressure: while the transport's buffer is over its high-water mark (the server does
not read), the connection does not read either (``pause_writing`` pauses reading), and the
protocol queues at most :data:`~services.serving.h2grpc.http2.MAX_UNWRITTEN_REPLIES` answers
to PINGs and SETTINGS until a write drains (:meth:`H2ClientConnection.written
<services.serving.h2grpc.http2.H2ClientConnection.written>`), past which the connection ends
with GOAWAY ENHANCE_YOUR_CALM.

Its work is done where the bytes arrive, in :meth:`H2Connection.data_received`, with no thread and
no task of its own; what the calls of one loop iteration queue goes out in one write. Each breach
of the protocol is counted through the ``on_protocol_error`` callback
(:class:`~services.serving.h2grpc.errors.Violation` labels).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import cast

import grpc

from services.serving.h2grpc.call import Call
from services.serving.h2grpc.errors import CallFailed, NotStarted, ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode
from services.serving.h2grpc.http2_events import (
    Breach,
    ConnectionEnded,
    Event,
    PingAcknowledged,
    SettingsAcknowledged,
    Settled,
    SlotsChanged,
)
from services.serving.h2grpc.protocol import ClientProtocol, StreamChanged

logger = logging.getLogger(__name__)

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
        settings_ack_timeout_s: float,
        on_protocol_error: ProtocolErrorHook | None = None,
    ) -> None:
        self.loop = loop
        self.target = target
        self.protocol = ClientProtocol(
            target, authority=authority, tls=tls, max_message_bytes=max_message_bytes
        )
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._settings_ack_timeout_s = settings_ack_timeout_s
        self._on_protocol_error = on_protocol_error
        self._transport: asyncio.Transport | None = None
        self._flush_scheduled = False
        self._slot_waiters: list[asyncio.Future[None]] = []
        self._ping_timer: asyncio.TimerHandle | None = None
        self._ping_deadline: asyncio.TimerHandle | None = None
        self._settings_ack_timer: asyncio.TimerHandle | None = None
        self._retired = False
        self.settled: asyncio.Future[None] = loop.create_future()
        """Done when the server's first SETTINGS came (its limits known): calls start after."""

    # -- the connection's life ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, but have its methods.
        self._transport = cast(asyncio.Transport, transport)
        self._transport.write(self.protocol.data_to_send())
        self._ping_timer = self.loop.call_later(self._keepalive_s, self._send_keepalive)
        self._settings_ack_timer = self.loop.call_later(
            self._settings_ack_timeout_s, self._settings_not_acknowledged
        )

    def connection_lost(self, exc: Exception | None) -> None:
        self._transport = None
        for timer in (self._ping_timer, self._ping_deadline, self._settings_ack_timer):
            if timer is not None:
                timer.cancel()
        reason = (
            f"connection to {self.target} lost: {exc}"
            if exc
            else f"{self.target} closed the connection"
        )
        self._handle(self.protocol.connection_lost(reason))
        self._ended(self.protocol.closed_reason or reason)

    def _ended(self, reason: str) -> None:
        self._wake_all(self._slot_waiters)
        if not self.settled.done():
            self.settled.set_exception(CallFailed(grpc.StatusCode.UNAVAILABLE, reason))

    @property
    def is_open(self) -> bool:
        return self._transport is not None

    @property
    def usable(self) -> bool:
        """Whether a new call may start here (open, no GOAWAY, stream ids left)."""
        return self._transport is not None and self.protocol.usable and not self._retired

    def retire(self) -> None:
        """No new call starts here; the connection closes once its calls ended."""
        self._retired = True
        if not self.protocol.streams:
            self.close("retired: every call finished")

    @property
    def closed_reason(self) -> str | None:
        return self.protocol.closed_reason or self.protocol.goaway_reason

    @property
    def held_bytes(self) -> int:
        """The bytes held for the open calls (:attr:`H2ClientConnection.held_bytes
        <services.serving.h2grpc.http2.H2ClientConnection.held_bytes>`) and not yet written."""
        held = self.protocol.held_bytes
        if self._transport is not None:
            held += self._transport.get_write_buffer_size()
        return held

    def close(self, reason: str) -> None:
        if self._transport is not None:
            self.protocol.close(reason)
            self._flush()
            self._transport.close()

    def _handle(self, events: list[Event]) -> None:
        """Act on the protocol's events: wake calls, count breaches, arm or stop timers."""
        for event in events:
            kind = type(event)
            if kind is StreamChanged:
                call = cast(Call, cast(StreamChanged, event).stream)
                if call.code is not None and call.deadline is not None:
                    call.deadline.cancel()
                    call.deadline = None
                call.wake()
            elif kind is SlotsChanged:
                self._wake_all(self._slot_waiters)
            elif kind is Breach:
                self._count(cast(Breach, event).violation)
            elif kind is Settled:
                if not self.settled.done():
                    self.settled.set_result(None)
            elif kind is SettingsAcknowledged:
                if self._settings_ack_timer is not None:
                    self._settings_ack_timer.cancel()
                    self._settings_ack_timer = None
            elif kind is PingAcknowledged:
                if self._ping_deadline is not None:
                    self._ping_deadline.cancel()
                    self._ping_deadline = None
                    self._ping_timer = self.loop.call_later(self._keepalive_s, self._send_keepalive)
            elif kind is ConnectionEnded:
                if self._transport is not None:
                    self._flush()
                    self._transport.abort()
                self._ended(cast(ConnectionEnded, event).reason)
        protocol = self.protocol
        if (
            (protocol.going_away or self._retired)
            and not protocol.streams
            and self._transport is not None
        ):
            self.close(protocol.goaway_reason or "GOAWAY: every call finished")
        elif protocol.has_data_to_send:
            self._schedule_flush()

    def _count(self, violation: str) -> None:
        if self._on_protocol_error is not None:
            try:
                self._on_protocol_error(violation)
            except Exception:
                logger.exception("the h2grpc protocol-error hook failed")

    def _schedule_flush(self) -> None:
        """What the calls of one loop iteration queue goes out in one write."""
        if not self._flush_scheduled and self._transport is not None:
            self._flush_scheduled = True
            self.loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        transport = self._transport
        if transport is not None and self.protocol.has_data_to_send:
            transport.write(self.protocol.data_to_send())
            if self.protocol.unwritten_replies and not transport.get_write_buffer_size():
                self.protocol.written()

    # -- writer backpressure: a server that does not read is not read either -----------------

    def pause_writing(self) -> None:
        """The transport's buffer passed its high-water mark (the server is not taking the
        client's bytes): stop reading, so its PINGs and SETTINGS queue no more answers; the
        keepalive ping's answer then goes unread and keepalive closes the connection."""
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.pause_reading()

    def resume_writing(self) -> None:
        transport = self._transport
        if transport is not None and not transport.is_closing():
            transport.resume_reading()
            if not transport.get_write_buffer_size():
                self.protocol.written()

    # -- calls --------------------------------------------------------------------------------

    async def start(
        self,
        path: bytes,
        payload: bytes,
        *,
        deadline: float | None,
        streaming: bool,
        metadata: bytes = b"",
    ) -> Call:
        """Send one call's request (headers with ``metadata``, the encoded fields of
        :func:`~services.serving.h2grpc.grpc_wire.metadata_block`, and its single message; what
        the server's windows do not take yet follows as they open) and return its
        :class:`Call`. Raises
        :class:`NotStarted` when the connection cannot take it (nothing was sent), DEADLINE_EXCEEDED
        when ``deadline`` (the loop's clock) passes while it waits for a free stream. The call
        is reset and fails DEADLINE_EXCEEDED when ``deadline`` comes."""
        if not self.protocol.has_room and self.usable:
            await self._wait_for_room(deadline)
        if not self.usable:
            raise NotStarted(self.closed_reason or f"connection to {self.target} is going away")
        call = Call(self, streaming=streaming)
        timeout_s = None if deadline is None else deadline - self.loop.time()
        self.protocol.open(call, path, payload, timeout_s=timeout_s, metadata=metadata)
        if deadline is not None:
            call.deadline = self.loop.call_at(deadline, self._deadline_passed, call)
        self._schedule_flush()
        return call

    async def _wait_for_room(self, deadline: float | None) -> None:
        """Until the server's MAX_CONCURRENT_STREAMS leaves room, the connection is unusable, or
        ``deadline`` (then DEADLINE_EXCEEDED)."""
        while not self.protocol.has_room and self.usable:
            waiter = self.loop.create_future()
            self._slot_waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except TimeoutError:
                raise CallFailed(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"Deadline Exceeded waiting for a stream to {self.target} (all "
                    f"{self.protocol.peer_max_streams} its MAX_CONCURRENT_STREAMS allows are "
                    f"in use)",
                ) from None

    @staticmethod
    def _wake_all(waiters: list[asyncio.Future[None]]) -> None:
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
        waiters.clear()

    def reset(self, call: Call, code: grpc.StatusCode, details: str) -> None:
        """End ``call`` from the client's side: RST_STREAM CANCEL, then the given status."""
        if call.code is None:
            self._handle(self.protocol.reset(call, code, details))

    def take(self, call: Call) -> bytes:
        """The call's next message, taken by its consumer (its window may open)."""
        message = self.protocol.take(call)
        if self.protocol.has_data_to_send:
            self._schedule_flush()
        return message

    def _deadline_passed(self, call: Call) -> None:
        call.deadline = None
        self.reset(call, grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")

    # -- receiving ----------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        events = self.protocol.receive(data)
        if events:
            self._handle(events)
        elif self.protocol.has_data_to_send:
            self._schedule_flush()

    # -- timers -------------------------------------------------------------------------------

    def _send_keepalive(self) -> None:
        self._ping_timer = None
        if self._transport is None:
            return
        self.protocol.ping(os.urandom(8))
        self._schedule_flush()
        self._ping_deadline = self.loop.call_later(self._keepalive_timeout_s, self._keepalive_lost)

    def _keepalive_lost(self) -> None:
        self._ping_deadline = None
        if self._transport is None:
            return
        reason = (
            f"{self.target} did not answer a keepalive ping within {self._keepalive_timeout_s:g} s"
        )
        logger.warning("%s: closing the connection", reason)
        self._handle(self.protocol.connection_lost(reason))
        self._transport.abort()

    def _settings_not_acknowledged(self) -> None:
        self._settings_ack_timer = None
        if self._transport is None:
            return
        self._handle(
            self.protocol.fail(
                ProtocolError(
                    Violation.SETTINGS_TIMEOUT,
                    ErrorCode.SETTINGS_TIMEOUT,
                    f"did not acknowledge the client's SETTINGS within "
                    f"{self._settings_ack_timeout_s:g} s",
                )
            )
        )
