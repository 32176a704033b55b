"""A gRPC server on raw HTTP/2 frames that breaks the protocol on request, for the h2grpc
client's tests (tests/integration/services/test_h2grpc_misbehaving.py).

It answers each request with the next of its ``behaviours`` (then :func:`good`, an echo), and
writes what no conforming library would: a truncated GOAWAY, a WINDOW_UPDATE of 0, a frame over
the client's maximum, CONTINUATION without end. It is written on the frame bytes (RFC 9113)
with the ``hpack`` package's encoder, not with h2grpc's own code, so the client is checked
against an independent reading of the protocol. It records what the client sent back (GOAWAY and
RST_STREAM codes) and how many connections it took.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = (
    0x0,
    0x1,
    0x3,
    0x4,
    0x6,
    0x7,
    0x8,
    0x9,
)
END_STREAM, ACK, END_HEADERS = 0x1, 0x1, 0x4
REFUSED_STREAM = 0x7


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">L", len(payload))[1:] + struct.pack(">BBL", kind, flags, stream_id) + payload
    )


@dataclass
class Exchange:
    """One request, for a behaviour to answer: its stream, its message, the connection."""

    stream_id: int
    message: bytes
    writer: asyncio.StreamWriter
    encoder: hpack.Encoder
    server: MisbehavingServer

    def headers(self, fields: list[tuple[str, str]], flags: int = END_HEADERS) -> bytes:
        return frame(HEADERS, flags, self.stream_id, self.encoder.encode(fields))

    def response_headers(self, *extra: tuple[str, str]) -> bytes:
        return self.headers([(":status", "200"), ("content-type", "application/grpc"), *extra])

    def trailers(self) -> bytes:
        return self.headers([("grpc-status", "0")], END_HEADERS | END_STREAM)


Behaviour = Callable[[Exchange], Awaitable[None]]


async def good(exchange: Exchange) -> None:
    """An echo of the request's message, as a gRPC server answers."""
    body = struct.pack(">BL", 0, len(exchange.message)) + exchange.message
    exchange.writer.write(
        exchange.response_headers() + frame(DATA, 0, exchange.stream_id, body) + exchange.trailers()
    )


def raw(make: Callable[[int], bytes]) -> Behaviour:
    """Writes ``make(stream_id)``'s bytes and nothing else."""

    async def behaviour(exchange: Exchange) -> None:
        exchange.writer.write(make(exchange.stream_id))

    return behaviour


truncated_goaway = raw(lambda stream: frame(GOAWAY, 0, 0, struct.pack(">L", 0)))
zero_window_update_on_the_connection = raw(lambda stream: frame(WINDOW_UPDATE, 0, 0, bytes(4)))
zero_window_update_on_the_stream = raw(lambda stream: frame(WINDOW_UPDATE, 0, stream, bytes(4)))
window_overflow_on_the_connection = raw(
    lambda stream: frame(WINDOW_UPDATE, 0, 0, struct.pack(">L", 2**31 - 1))
)
window_overflow_on_the_stream = raw(
    lambda stream: frame(WINDOW_UPDATE, 0, stream, struct.pack(">L", 2**31 - 1))
)
data_on_a_stream_never_opened = raw(lambda stream: frame(DATA, 0, stream + 2, bytes(5)))
settings_of_seven_bytes = raw(lambda stream: frame(SETTINGS, 0, 0, bytes(7)))
refused_stream = raw(lambda stream: frame(RST_STREAM, 0, stream, struct.pack(">L", REFUSED_STREAM)))


async def oversized_data_frame(exchange: Exchange) -> None:
    """Headers, then one DATA frame of 20,000 bytes (the client's maximum is 16,384)."""
    exchange.writer.write(
        exchange.response_headers() + frame(DATA, 0, exchange.stream_id, bytes(20_000))
    )


async def huge_header_list(exchange: Exchange) -> None:
    """Headers whose block is small (one 3,000-byte field indexed, then named 25 times by its
    index) and whose list is about 76 KB, as RFC 9113 counts it."""
    fields = [(":status", "200"), ("content-type", "application/grpc")]
    exchange.writer.write(exchange.headers(fields + [("x-big", "v" * 3000)] * 25))


async def binary_metadata_not_base64(exchange: Exchange) -> None:
    """An echo whose trailers carry ``x-blob-bin: a`` (one base64 character cannot be)."""
    body = struct.pack(">BL", 0, len(exchange.message)) + exchange.message
    exchange.writer.write(
        exchange.response_headers()
        + frame(DATA, 0, exchange.stream_id, body)
        + exchange.headers([("grpc-status", "0"), ("x-blob-bin", "a")], END_HEADERS | END_STREAM)
    )


async def compressed_message(exchange: Exchange) -> None:
    """A gzip-compressed echo (grpc-encoding gzip), which the client never asked for."""
    packed = gzip.compress(exchange.message)
    exchange.writer.write(
        exchange.response_headers(("grpc-encoding", "gzip"))
        + frame(DATA, 0, exchange.stream_id, struct.pack(">BL", 1, len(packed)) + packed)
        + exchange.trailers()
    )


async def endless_continuation(exchange: Exchange) -> None:
    """HEADERS without END_HEADERS, then CONTINUATION frames of 16,384 bytes until the client
    closes the connection (or 64 MiB went)."""
    exchange.writer.write(
        frame(HEADERS, 0, exchange.stream_id, exchange.encoder.encode([(":status", "200")]))
    )
    chunk = frame(
        CONTINUATION, 0, exchange.stream_id, b"\x00\x01a\x01b" * 3276 + b"\x00\x00\x00\x00"
    )
    with contextlib.suppress(ConnectionError):
        while exchange.server.continuation_bytes < 64 << 20 and not exchange.writer.is_closing():
            exchange.writer.write(chunk)
            exchange.server.continuation_bytes += len(chunk) - 9
            await exchange.writer.drain()


@dataclass
class MisbehavingServer:
    """Listens on 127.0.0.1; answers the n-th request with ``behaviours[n]`` (then echoes)."""

    behaviours: list[Behaviour]
    connections: int = 0
    goaways: list[tuple[int, bytes]] = field(default_factory=list)
    """(error code, debug data) of each GOAWAY the client sent."""
    resets: list[tuple[int, int]] = field(default_factory=list)
    """(stream id, error code) of each RST_STREAM the client sent."""
    continuation_bytes: int = 0
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    _received: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at each frame the client sends."""

    async def start(self) -> int:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port: int = self._server.sockets[0].getsockname()[1]
        return port

    async def close(self) -> None:
        assert self._server is not None
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds (the caller bounds the wait)."""
        while not condition():
            self._received.clear()
            await self._received.wait()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        encoder = hpack.Encoder()
        bodies: dict[int, bytearray] = {}
        try:
            if await reader.readexactly(len(PREFACE)) != PREFACE:
                return
            writer.write(frame(SETTINGS, 0, 0))
            while True:
                header = await reader.readexactly(9)
                length = int.from_bytes(header[:3], "big")
                kind, flags, stream_id = header[3], header[4], int.from_bytes(header[5:], "big")
                payload = await reader.readexactly(length)
                self._received.set()
                if kind == SETTINGS and not flags & ACK:
                    writer.write(frame(SETTINGS, ACK, 0))
                elif kind == PING and not flags & ACK:
                    writer.write(frame(PING, ACK, 0, payload))
                elif kind == GOAWAY:
                    self.goaways.append((int.from_bytes(payload[4:8], "big"), payload[8:]))
                elif kind == RST_STREAM:
                    self.resets.append((stream_id, int.from_bytes(payload, "big")))
                elif kind == HEADERS:
                    bodies[stream_id] = bytearray()
                elif kind == DATA:
                    bodies[stream_id] += payload
                if kind == DATA and flags & END_STREAM:
                    message = bytes(bodies.pop(stream_id)[5:])  # the client never compresses
                    behaviour = self.behaviours.pop(0) if self.behaviours else good
                    exchange = Exchange(stream_id, message, writer, encoder, self)
                    # A task: the connection's frames are still read while it answers.
                    task = asyncio.create_task(behaviour(exchange))
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
