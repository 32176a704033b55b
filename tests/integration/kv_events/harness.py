"""Test helpers for KV-event streams: a recording sink, free ports and a TCP proxy that can
cut or freeze the connection between a subscriber and a publisher."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

from services.kv_events.events import EventBatch

WAIT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def wait_until(predicate: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class RecordingSink:
    """An :class:`~services.kv_events.subscriber.EventSink` that keeps everything."""

    def __init__(self) -> None:
        self.applied: list[tuple[int, EventBatch]] = []
        self.drops: list[str] = []
        self.log: list[tuple[object, ...]] = []

    @property
    def seqs(self) -> list[int]:
        return [seq for seq, _ in self.applied]

    def apply(self, seq: int, batch: EventBatch) -> None:
        self.applied.append((seq, batch))
        self.log.append(("apply", seq))

    def dropped(self, reason: str) -> None:
        self.drops.append(reason)

    def stale(self, reason: str, *, lost: bool) -> None:
        self.log.append(("stale", reason, lost))

    def resumed(self) -> None:
        self.log.append(("resumed",))

    def events(self, kind: str) -> list[tuple[object, ...]]:
        return [entry for entry in self.log if entry[0] == kind]


class Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``; :meth:`cut` drops every connection
    and stops listening, :meth:`restore` listens again, :meth:`freeze` stops forwarding bytes
    while keeping the connections open (a hung peer)."""

    def __init__(self, target: int) -> None:
        self._target = target
        self.port = free_port()
        self._server: asyncio.Server | None = None
        self._transports: list[asyncio.BaseTransport] = []
        self._thawed = asyncio.Event()
        self._thawed.set()
        self._tasks: set[asyncio.Task[None]] = set()

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for transport in self._transports:
            transport.abort()  # type: ignore[attr-defined]
        self._transports.clear()

    def freeze(self) -> None:
        self._thawed.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self._target)
        except OSError:
            writer.transport.abort()
            return
        self._transports += [writer.transport, up_writer.transport]
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            while data := await reader.read(65536):
                await self._thawed.wait()
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    async def close(self) -> None:
        self._thawed.set()
        await self.cut()
