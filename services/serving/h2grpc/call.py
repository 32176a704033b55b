"""One call's stream on an :class:`~services.serving.h2grpc.connection.H2Connection`: what the
server sent so far, then its status. The connection fills it as frames arrive; the channel reads
it (:meth:`Call.wait`) and cancels it when its caller leaves."""

from __future__ import annotations

import asyncio
import collections
from typing import TYPE_CHECKING

import grpc

from services.serving.h2grpc.errors import CallFailed, Metadata

if TYPE_CHECKING:
    from services.serving.h2grpc.connection import H2Connection


class Call:
    """One call's stream: what the server sent so far, then its status.

    ``messages`` fills as messages arrive; ``code`` is ``None`` while the call is open and
    the call's status once it ended (OK included); :meth:`wait` returns when either moved.
    ``buffer`` (a message's bytes so far), ``headers_seen``, ``encoding`` (the response's
    ``grpc-encoding``, for the error of a compressed message), ``send_window``, ``received``
    (bytes since the stream's window was last opened) and ``deadline`` (its timer) are the
    connection's to read and write.
    """

    __slots__ = (
        "_connection",
        "_waiter",
        "buffer",
        "code",
        "deadline",
        "details",
        "encoding",
        "headers_seen",
        "messages",
        "metadata",
        "received",
        "send_window",
        "stream_id",
        "streaming",
    )

    def __init__(self, connection: H2Connection, stream_id: int, *, streaming: bool) -> None:
        self.stream_id = stream_id
        self.messages: collections.deque[bytes] = collections.deque()
        self.code: grpc.StatusCode | None = None
        self.details = ""
        self.metadata: Metadata = ()
        self._connection = connection
        self.streaming = streaming
        self._waiter: asyncio.Future[None] | None = None
        self.buffer: bytes | bytearray = b""
        self.headers_seen = False
        self.encoding = ""
        self.send_window = connection.peer_initial_window
        self.received = 0
        self.deadline: asyncio.TimerHandle | None = None

    async def wait(self) -> None:
        """Until a message arrives (streaming calls) or the call ends."""
        if self.code is not None or (self.streaming and self.messages):
            return
        self._waiter = self._connection.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

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
