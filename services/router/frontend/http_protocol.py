"""The router's HTTP/1.1 protocol: uvicorn's httptools protocol, whose writes of one loop
iteration go to the socket together.

uvicorn writes a response's status line and headers, then its body, with two transport writes;
on uvloop each write is a ``send`` at once, so a JSON answer cost two system calls and two TCP
segments, and woke its client twice (docs/router.md "CPU per request").
:class:`CoalescingTransport` queues the writes made while one callback runs and sends them with
one write when the loop comes round (``call_soon``), before any later callback: nothing waits on
a timer, and closing the connection sends what is queued first.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class CoalescingTransport:
    """A transport whose writes of one loop iteration become one write of the transport under
    it; every other method is the transport's own."""

    __slots__ = ("_loop", "_out", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._out: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._out.append(bytes(data))
        if len(self._out) == 1:
            self._loop.call_soon(self._flush)

    def writelines(self, lines: Any) -> None:
        for data in lines:
            self.write(data)

    def _flush(self) -> None:
        out, self._out = self._out, []
        if out and not self._transport.is_closing():
            self._transport.write(out[0] if len(out) == 1 else b"".join(out))

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def abort(self) -> None:
        self._out = []
        self._transport.abort()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(data) for data in self._out)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CoalescingHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's ``httptools`` protocol over a :class:`CoalescingTransport` (pass the class as
    ``uvicorn.Config(http=...)``)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        coalescing = CoalescingTransport(transport, self.loop)
        super().connection_made(coalescing)  # type: ignore[arg-type]
