"""One call on an :class:`~services.serving.h2grpc.connection.H2Connection`: its stream's state
(:class:`~services.serving.h2grpc.protocol.Stream`, filled by the protocol as frames arrive) and
what the event loop needs around it: a waiter for its reader (:meth:`Call.wait`), its deadline
timer, and the way back to its connection to take messages (:meth:`Call.take`, which opens the
stream's window again) and to cancel it."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from services.serving.h2grpc.errors import CallFailed
from services.serving.h2grpc.protocol import Stream

if TYPE_CHECKING:
    from services.serving.h2grpc.connection import H2Connection


class Call(Stream):
    """One call: a :class:`~services.serving.h2grpc.protocol.Stream` (``unread`` messages, then
    ``code``, ``details`` and ``metadata``) with a waiter. :meth:`wait` returns when a message
    arrived (streaming calls) or the call ended. ``deadline`` (its timer) is the connection's;
    ``retried``: this call is the second try of one the server never processed (the channel's).
    """

    __slots__ = ("_connection", "_waiter", "deadline", "retried")

    def __init__(self, connection: H2Connection, *, streaming: bool) -> None:
        super().__init__(streaming=streaming)
        self._connection = connection
        self._waiter: asyncio.Future[None] | None = None
        self.deadline: asyncio.TimerHandle | None = None
        self.retried = False

    @property
    def connection(self) -> H2Connection:
        return self._connection

    async def wait(self) -> None:
        """Until a message arrives (streaming calls) or the call ends."""
        if self.code is not None or (self.streaming and self.unread):
            return
        self._waiter = self._connection.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def take(self) -> bytes:
        """The next message (``unread`` says there is one): read, so the server may send
        more."""
        return self._connection.take(self)

    def failure(self) -> CallFailed:
        assert self.code is not None and self.code is not grpc.StatusCode.OK
        return CallFailed(self.code, self.details, self.metadata)

    def cancel(self) -> None:
        """End the call on the client's side (RST_STREAM CANCEL) if it is still open."""
        if self.code is None:
            self._connection.reset(self, grpc.StatusCode.CANCELLED, "cancelled by the client")

    def wake(self) -> None:
        """Resume :meth:`wait` (the connection calls it when a message or the status came)."""
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
