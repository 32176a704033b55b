"""A gRPC server that breaks HTTP/2 on request, for the h2grpc client's tests
(tests/integration/services/test_h2grpc_misbehaving.py and test_h2grpc_misbehaving_bounds.py).

It answers each request with the next of its ``behaviours`` (then :func:`good`, an echo). Its
conforming part is the ``h2`` package's server (``h2.connection.H2Connection``): the preface,
SETTINGS and their ACK, PING answers, the request's HEADERS and DATA, the response's headers,
DATA and trailers, flow control both ways (its sends wait for the client's WINDOW_UPDATEs; its
own window updates acknowledge the request's data). What h2 refuses to write is written as raw
frame bytes beside h2's output, after it: a truncated GOAWAY, a WINDOW_UPDATE of 0 or past
2^31-1, a frame over the client's maximum, SETTINGS of 7 bytes, DATA on a stream never opened,
CONTINUATION without end (empty or not), PINGs without end, answers whose header blocks (literals
never indexed) carry what h2 would not send (a ``:status`` or ``grpc-status`` that is not a
number, an HTML 200), and GOAWAY itself (h2 closes its state machine at its own GOAWAY and
then refuses the calls it did take, and every frame the client still sends, where RFC 9113 §6.8
lets the connection finish them). A raw frame never changes HPACK's state: h2's encoder stays
the client's decoder's peer. Options at the connection level: the settings it advertises,
SETTINGS never acknowledged, the socket no longer read after a request's headers, the first
connections never spoken to (``silent_connections``).

So the client is checked against an independent reading of the protocol, not its own code. The
server records what the client sent (GOAWAY and RST_STREAM codes, read from the bytes before h2
sees them), how many connections it took and how many the client closed, the DATA bytes its
behaviours sent and the times they waited on a send window of 0, and what h2 rejected of the
client's frames (``rejected``: a breach by the client, each closing its connection).
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import struct
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
import hpack
from h2.errors import ErrorCodes
from h2.settings import SettingCodes

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
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
REFUSED_STREAM = ErrorCodes.REFUSED_STREAM

ENDLESS_CAP = 16 << 20
"""Bytes after which an endless answer (:func:`endless_stream`) stops sending, to keep a test
that fails (a client without flow control) from filling the memory."""


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return (
        struct.pack(">L", len(payload))[1:] + struct.pack(">BBL", kind, flags, stream_id) + payload
    )


def goaway(last_stream_id: int, code: int = ErrorCodes.NO_ERROR) -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">LL", last_stream_id, code))


def message(payload: bytes, *, compressed: bool = False) -> bytes:
    """A gRPC length-prefixed message."""
    return struct.pack(">BL", int(compressed), len(payload)) + payload


class FrameReader:
    """Whole frames out of a byte stream fed in pieces: (kind, flags, stream id, payload),
    after the client's preface when ``preface``."""

    def __init__(self, *, preface: bool = False) -> None:
        self._buffer = bytearray()
        self._preface = preface

    def feed(self, data: bytes) -> Iterator[tuple[int, int, int, bytes]]:
        self._buffer += data
        if self._preface:
            if len(self._buffer) < len(PREFACE):
                return
            del self._buffer[: len(PREFACE)]  # h2 checks it
            self._preface = False
        while len(self._buffer) >= 9:
            length = int.from_bytes(self._buffer[:3], "big")
            if len(self._buffer) < 9 + length:
                return
            kind, flags = self._buffer[3], self._buffer[4]
            stream_id = int.from_bytes(self._buffer[5:9], "big") & 0x7FFF_FFFF
            payload = bytes(self._buffer[9 : 9 + length])
            del self._buffer[: 9 + length]
            yield kind, flags, stream_id, payload


def without_settings_acks(data: bytes) -> bytes:
    """h2's output (whole frames) less its SETTINGS ACKs."""
    return b"".join(
        frame(kind, flags, stream_id, payload)
        for kind, flags, stream_id, payload in FrameReader().feed(data)
        if not (kind == SETTINGS and flags & ACK)
    )


class Link:
    """One connection: h2's state and the socket, shared by its exchanges."""

    def __init__(self, server: MisbehavingServer, writer: asyncio.StreamWriter) -> None:
        self.server = server
        self.writer = writer
        config = h2.config.H2Configuration(client_side=False, header_encoding="utf-8")
        self.h2 = h2.connection.H2Connection(config)
        self.h2.local_settings = h2.settings.Settings(
            client=False,
            initial_values={
                SettingCodes.MAX_CONCURRENT_STREAMS: 100,  # h2's defaults
                SettingCodes.MAX_HEADER_LIST_SIZE: 1 << 16,
                **server.settings,
            },
        )
        self.held = False
        """A raw header block is being written: h2's output waits (it would interrupt it)."""
        self.window_opened = asyncio.Event()
        """Set at each WINDOW_UPDATE from the client, and when the connection ends."""
        self.ended = False
        self.closing = asyncio.Event()
        """Set when the server closes."""

    def flush(self) -> None:
        """Write what h2 has to send."""
        if self.held or self.ended:
            return
        data = self.h2.data_to_send()
        if data and not self.server.ack_settings:
            data = without_settings_acks(data)
        if data:
            self.writer.write(data)

    def write_raw(self, data: bytes) -> None:
        """Write ``data`` after what h2 has to send; h2 knows nothing of it."""
        self.flush()
        if not self.ended:
            self.writer.write(data)


@dataclass
class Exchange:
    """One request, for a behaviour to answer: its stream, its message, the connection."""

    stream_id: int
    message: bytes
    link: Link

    @property
    def server(self) -> MisbehavingServer:
        return self.link.server

    def headers(self, *extra: tuple[str, str], end_stream: bool = False) -> None:
        """The response's headers (:status 200, content-type application/grpc, ``extra``)."""
        fields = [(":status", "200"), ("content-type", "application/grpc"), *extra]
        self.link.h2.send_headers(self.stream_id, fields, end_stream=end_stream)
        self.link.flush()

    def trailers(self, *extra: tuple[str, str]) -> None:
        """Trailers with grpc-status 0 and ``extra``, ending the stream."""
        self.link.h2.send_headers(self.stream_id, [("grpc-status", "0"), *extra], end_stream=True)
        self.link.flush()

    async def data(self, payload: bytes, *, end_stream: bool = False) -> None:
        """``payload`` in DATA frames, as the client's windows and max frame size allow: waits
        for its WINDOW_UPDATEs (counted in ``server.send_window_waits``) and for the socket."""
        link, view = self.link, memoryview(payload)
        while True:
            if link.ended:
                raise ConnectionError("the connection ended")
            room = min(
                link.h2.local_flow_control_window(self.stream_id), link.h2.max_outbound_frame_size
            )
            if room <= 0 and view:
                self.server.send_window_waits += 1
                self.server.changed()
                link.window_opened.clear()
                await link.window_opened.wait()
                continue
            chunk, view = view[:room], view[room:]
            link.h2.send_data(self.stream_id, bytes(chunk), end_stream=end_stream and not view)
            self.server.data_bytes_sent += len(chunk)
            link.flush()
            await link.writer.drain()
            if not view:
                return

    async def send_message(self, payload: bytes, *, compressed: bool = False) -> None:
        await self.data(message(payload, compressed=compressed))

    def reset(self, code: int) -> None:
        self.link.h2.reset_stream(self.stream_id, code)
        self.link.flush()

    def raw(self, data: bytes) -> None:
        self.link.write_raw(data)


Behaviour = Callable[[Exchange], Awaitable[None]]


async def good(exchange: Exchange) -> None:
    """An echo of the request's message, as a gRPC server answers."""
    exchange.headers()
    await exchange.send_message(exchange.message)
    exchange.trailers()


def raw(make: Callable[[int], bytes]) -> Behaviour:
    """Writes ``make(stream_id)``'s bytes and nothing else."""

    async def behaviour(exchange: Exchange) -> None:
        exchange.raw(make(exchange.stream_id))

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
goaway_not_taken = raw(lambda stream: goaway(max(stream - 2, 0)))
"""GOAWAY (NO_ERROR) whose last stream is the one before the request's: the server says it did
not take the request, and answers nothing on its stream."""


async def refused_stream(exchange: Exchange) -> None:
    """RST_STREAM REFUSED_STREAM before any response headers (the request not processed)."""
    exchange.reset(REFUSED_STREAM)


async def silent(exchange: Exchange) -> None:
    """No answer at all."""


async def hold(exchange: Exchange) -> None:
    """No answer, the stream held open until the server closes."""
    await exchange.link.closing.wait()


def stream_of(request: bytes) -> list[bytes]:
    """The messages :func:`goaway_mid_stream` answers ``request`` with."""
    return [request + b" %d" % n for n in range(4)]


async def goaway_mid_stream(exchange: Exchange) -> None:
    """A server-streaming answer (:func:`stream_of`) with a GOAWAY (NO_ERROR, last stream this
    one: the call was taken) after its first message, then the rest of the stream and trailers.
    The pauses let the parts arrive in separate reads (the outcome does not depend on them)."""
    exchange.headers()
    for n, part in enumerate(stream_of(exchange.message)):
        if n == 1:
            exchange.raw(goaway(exchange.stream_id))
        await exchange.send_message(part)
        await asyncio.sleep(0.01)
    exchange.trailers()


async def endless_stream(exchange: Exchange) -> None:
    """Messages of 1 KiB as fast as the client's windows let them go, the stream never ended
    (sending stops at :data:`ENDLESS_CAP` bytes, then the stream is held open)."""
    exchange.headers()
    while exchange.server.data_bytes_sent < ENDLESS_CAP:
        await exchange.send_message(bytes(1024))
    await hold(exchange)


async def oversized_data_frame(exchange: Exchange) -> None:
    """Headers, then one DATA frame of 20,000 bytes (the client's maximum is 16,384)."""
    exchange.headers()
    exchange.raw(frame(DATA, 0, exchange.stream_id, bytes(20_000)))


async def huge_header_list(exchange: Exchange) -> None:
    """Headers whose block is small (one 3,000-byte field indexed by HPACK, then named 24 more
    times by its index) and whose list is about 76 KB, as RFC 9113 counts it, over the client's
    SETTINGS_MAX_HEADER_LIST_SIZE (advisory: h2 sends it)."""
    exchange.headers(*[("x-big", "v" * 3000)] * 25)


async def binary_metadata_not_base64(exchange: Exchange) -> None:
    """An echo whose trailers carry ``x-blob-bin: a`` (one base64 character cannot be)."""
    exchange.headers()
    await exchange.send_message(exchange.message)
    exchange.trailers(("x-blob-bin", "a"))


async def compressed_message(exchange: Exchange) -> None:
    """A gzip-compressed echo (grpc-encoding gzip), which the client never asked for."""
    exchange.headers(("grpc-encoding", "gzip"))
    await exchange.send_message(gzip.compress(exchange.message), compressed=True)
    exchange.trailers()


async def endless_continuation(exchange: Exchange) -> None:
    """HEADERS without END_HEADERS, then CONTINUATION frames of 16,384 bytes until the client
    closes the connection (or 64 MiB went). Their fields are literals never indexed: HPACK's
    state does not move."""
    link = exchange.link
    link.flush()
    link.held = True  # nothing of h2's may come inside the block
    status_200 = b"\x88"  # static table index 8
    exchange.raw(frame(HEADERS, 0, exchange.stream_id, status_200))
    chunk = frame(
        CONTINUATION, 0, exchange.stream_id, b"\x00\x01a\x01b" * 3276 + b"\x00\x00\x00\x00"
    )
    with contextlib.suppress(ConnectionError):
        while exchange.server.continuation_bytes < 64 << 20 and not link.writer.is_closing():
            link.writer.write(chunk)
            exchange.server.continuation_bytes += len(chunk) - 9
            await link.writer.drain()


async def endless_empty_continuation(exchange: Exchange) -> None:
    """HEADERS without END_HEADERS, then empty CONTINUATION frames (1,000 a write) until the
    client closes the connection (or 10 million went): a block that never grows."""
    link = exchange.link
    link.flush()
    link.held = True
    exchange.raw(frame(HEADERS, 0, exchange.stream_id, b"\x88"))
    chunk = frame(CONTINUATION, 0, exchange.stream_id) * 1000
    with contextlib.suppress(ConnectionError):
        while exchange.server.continuation_frames < 10_000_000 and not link.writer.is_closing():
            link.writer.write(chunk)
            exchange.server.continuation_frames += 1000
            await link.writer.drain()


def endless_messages(size: int) -> Behaviour:
    """A streaming answer of ``size``-byte messages (1,000 a DATA write) as fast as the client's
    windows let them go, never ended (sending stops at :data:`ENDLESS_CAP` bytes, then the
    stream is held open)."""

    async def behaviour(exchange: Exchange) -> None:
        exchange.headers()
        batch = message(b"\x01" * size) * 1000
        while exchange.server.data_bytes_sent < ENDLESS_CAP:
            await exchange.data(batch)
        await hold(exchange)

    return behaviour


async def one_empty_message_then_hold(exchange: Exchange) -> None:
    """A streaming answer's headers and one empty message (a default protobuf), then nothing."""
    exchange.headers()
    await exchange.send_message(b"")
    await hold(exchange)


def never_indexed(fields: list[tuple[str, str]]) -> bytes:
    """A header block of literals never indexed (a fresh encoder: names from the static table
    at most): HPACK's state does not move, so it may be written raw beside h2's."""
    encoder = hpack.Encoder()
    return encoder.encode([hpack.NeverIndexedHeaderTuple(n, v) for n, v in fields], huffman=False)


def raw_answer(
    response: list[tuple[str, str]],
    trailers: list[tuple[str, str]] | None = None,
    *,
    body: bytes | None = None,
) -> Behaviour:
    """An answer written raw (values h2 would not send): ``response`` headers, ``body`` as
    one DATA frame (default: the request echoed as a gRPC message), then ``trailers`` (ending
    the stream) when given."""

    async def behaviour(exchange: Exchange) -> None:
        stream_id = exchange.stream_id
        out = frame(HEADERS, END_HEADERS, stream_id, never_indexed(response))
        out += frame(DATA, 0, stream_id, message(exchange.message) if body is None else body)
        if trailers is not None:
            out += frame(HEADERS, END_HEADERS | END_STREAM, stream_id, never_indexed(trailers))
        exchange.raw(out)

    return behaviour


GRPC_200 = [(":status", "200"), ("content-type", "application/grpc")]
grpc_status_superscript = raw_answer(GRPC_200, [("grpc-status", "²")])
grpc_status_of_5000_digits = raw_answer(GRPC_200, [("grpc-status", "9" * 5000)])
grpc_status_a_word_without_message = raw_answer(GRPC_200, [("grpc-status", "OK")])
http_status_superscript = raw_answer([(":status", "²00"), ("content-type", "application/grpc")])
html_200 = raw_answer(
    [(":status", "200"), ("content-type", "text/html")], body=b"<html>not gRPC</html>"
)


async def ping_flood(exchange: Exchange) -> None:
    """The socket no longer read, PINGs (1,000 a write) until the client closes the connection
    (or 20 million went): their answers can only pile up in the client."""
    link = exchange.link
    link.flush()
    link.writer.transport.pause_reading()
    chunk = frame(PING, 0, 0, b"flooding") * 1000
    with contextlib.suppress(ConnectionError):
        while exchange.server.pings_sent < 20_000_000 and not link.writer.is_closing():
            link.writer.write(chunk)
            exchange.server.pings_sent += 1000
            await link.writer.drain()


@dataclass
class MisbehavingServer:
    """Listens on 127.0.0.1; answers the n-th request with ``behaviours[n]`` (then echoes).

    ``settings`` are advertised besides h2's defaults (INITIAL_WINDOW_SIZE,
    MAX_CONCURRENT_STREAMS...); ``ack_settings`` False never acknowledges the client's SETTINGS;
    ``read_after_request`` False stops reading a connection at its first request's headers and
    sends no WINDOW_UPDATE (the client's data then waits on flow control, its other frames in the
    socket)."""

    behaviours: list[Behaviour]
    settings: dict[SettingCodes, int] = field(default_factory=dict)
    ack_settings: bool = True
    read_after_request: bool = True
    connections: int = 0
    closed_by_client: int = 0
    """Connections whose end the client sent (EOF)."""
    requests: int = 0
    """Requests whose headers came."""
    goaways: list[tuple[int, bytes]] = field(default_factory=list)
    """(error code, debug data) of each GOAWAY the client sent."""
    resets: list[tuple[int, int]] = field(default_factory=list)
    """(stream id, error code) of each RST_STREAM the client sent."""
    rejected: list[str] = field(default_factory=list)
    """What h2 rejected of the client's frames (h2's exception), each closing its connection."""
    errors: list[BaseException] = field(default_factory=list)
    """The behaviours' own failures (a bug of this server's), but the client's ending streams
    and connections."""
    continuation_bytes: int = 0
    continuation_frames: int = 0
    pings_sent: int = 0
    silent_connections: int = 0
    """The first connections that never speak HTTP/2 (TCP accepted, nothing sent, what comes
    ignored)."""
    data_bytes_sent: int = 0
    """DATA bytes the behaviours sent (:meth:`Exchange.data`), on every stream."""
    send_window_waits: int = 0
    """Times a behaviour waited on a send window of 0 (the client's flow control held it)."""
    _server: asyncio.Server | None = None
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)
    """The behaviours' answers."""
    _links: dict[Link, asyncio.Task[None]] = field(default_factory=dict)
    """The open connections and the tasks that serve them."""
    _changed: asyncio.Event = field(default_factory=asyncio.Event)
    """Set at each frame the client sends, connection that ends, send window wait."""

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
        # The connections' tasks are asyncio's (start_server), ended by closing them, not
        # cancelled: a cancelled one is logged as an error.
        for link in self._links:
            link.closing.set()
            link.writer.transport.abort()
        await asyncio.gather(*self._links.values(), return_exceptions=True)
        await self._server.wait_closed()

    async def wait_for(self, condition: Callable[[], bool]) -> None:
        """Until ``condition()`` holds (the caller bounds the wait)."""
        while not condition():
            self._changed.clear()
            await self._changed.wait()

    def changed(self) -> None:
        self._changed.set()

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.changed()
        link = Link(self, writer)
        task = asyncio.current_task()
        assert task is not None
        self._links[link] = task
        if self.connections <= self.silent_connections:
            try:
                with contextlib.suppress(ConnectionError):
                    await reader.read()  # until the client gives up (or close() ends it)
            finally:
                self._links.pop(link, None)
                writer.close()
            return
        tap = FrameReader(preface=True)
        bodies: dict[int, bytearray] = {}
        try:
            link.h2.initiate_connection()
            link.flush()
            while True:
                data = await reader.read(1 << 16)
                if not data:
                    self.closed_by_client += 1
                    return
                self._record(tap.feed(data))
                try:
                    events = link.h2.receive_data(data)
                except h2.exceptions.ProtocolError as error:
                    self.rejected.append(repr(error))
                    link.flush()  # h2's GOAWAY
                    return
                stop_reading = False
                for event in events:
                    if isinstance(event, h2.events.RequestReceived):
                        self.requests += 1
                        bodies[event.stream_id] = bytearray()
                        stop_reading = stop_reading or not self.read_after_request
                    elif isinstance(event, h2.events.DataReceived):
                        bodies[event.stream_id] += event.data
                        if self.read_after_request:  # else no WINDOW_UPDATE ever
                            link.h2.acknowledge_received_data(
                                event.flow_controlled_length, event.stream_id
                            )
                    elif isinstance(event, h2.events.StreamEnded):
                        body = bodies.pop(event.stream_id)
                        behaviour = self.behaviours.pop(0) if self.behaviours else good
                        # The client never compresses: the message is the body after its prefix.
                        exchange = Exchange(event.stream_id, bytes(body[5:]), link)
                        # A task: the connection's frames are still read while it answers.
                        self._spawn(self._answer(behaviour, exchange))
                    elif isinstance(event, h2.events.WindowUpdated):
                        link.window_opened.set()
                    elif isinstance(event, h2.events.StreamReset):
                        bodies.pop(event.stream_id, None)
                link.flush()
                self.changed()
                if stop_reading:
                    await link.closing.wait()
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self._links.pop(link, None)
            link.ended = True
            link.window_opened.set()
            self.changed()
            writer.close()

    def _record(self, frames: Iterator[tuple[int, int, int, bytes]]) -> None:
        for kind, _flags, stream_id, payload in frames:
            if kind == GOAWAY:
                self.goaways.append((int.from_bytes(payload[4:8], "big"), payload[8:]))
            elif kind == RST_STREAM:
                self.resets.append((stream_id, int.from_bytes(payload, "big")))

    async def _answer(self, behaviour: Behaviour, exchange: Exchange) -> None:
        try:
            await behaviour(exchange)
        except (h2.exceptions.StreamClosedError, ConnectionError):
            pass  # the client ended the stream or the connection
        except Exception as exc:
            if not exchange.link.ended:
                self.errors.append(exc)
