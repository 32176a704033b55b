"""The h2grpc client's sans-IO protocol on bytes: flow control both ways (the backpressure a slow
reader puts on the server), what makes a call safe to send again, and breaches that end the
connection; no socket, no event loop. And the core's layers: HTTP/2's modules import nothing of
gRPC's."""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import grpc
import hpack
import pytest

from services.serving.h2grpc import frames, grpc_wire
from services.serving.h2grpc.errors import ProtocolError, Violation
from services.serving.h2grpc.frames import ErrorCode, Flag, FrameType, Setting
from services.serving.h2grpc.http2_base import STREAM_WINDOW
from services.serving.h2grpc.http2_events import (
    Breach,
    ConnectionEnded,
    Event,
    SettingsAcknowledged,
    Settled,
)
from services.serving.h2grpc.protocol import ClientProtocol, Stream

PATH = b"/test.Echo/Echo"
MAX_MESSAGE = 8 << 20


def parsed(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """The frames in ``data`` (the preface skipped) as (type, flags, stream id, payload)."""
    if data.startswith(frames.PREFACE):
        data = data[len(frames.PREFACE) :]
    out, offset = [], 0
    while offset < len(data):
        length, kind, flags, stream_id = frames.parse_frame_header(data, offset)
        start = offset + frames.FRAME_HEADER_BYTES
        out.append((kind, flags, stream_id, data[start : start + length]))
        offset = start + length
    return out


def window_updates(data: bytes) -> dict[int, int]:
    updates: dict[int, int] = {}
    for kind, _, stream_id, payload in parsed(data):
        if kind == FrameType.WINDOW_UPDATE:
            updates[stream_id] = updates.get(stream_id, 0) + struct.unpack(">L", payload)[0]
    return updates


def kinds(events: list[Event]) -> list[type]:
    return [type(event) for event in events]


def settled(server_settings: dict[int, int] | None = None) -> ClientProtocol:
    protocol = ClientProtocol(
        "engine:1", authority=b"engine:1", tls=False, max_message_bytes=MAX_MESSAGE
    )
    sent = parsed(protocol.data_to_send())
    assert sent[0][0] == FrameType.SETTINGS
    assert (Setting.INITIAL_WINDOW_SIZE, STREAM_WINDOW) in [
        struct.unpack_from(">HL", sent[0][3], offset) for offset in range(0, len(sent[0][3]), 6)
    ]
    assert Settled in kinds(protocol.receive(frames.settings(server_settings or {})))
    assert parsed(protocol.data_to_send()) == [(FrameType.SETTINGS, Flag.ACK, 0, b"")]
    assert SettingsAcknowledged in kinds(protocol.receive(frames.SETTINGS_ACK))
    return protocol


def answer_headers(stream_id: int, encoder: hpack.Encoder) -> bytes:
    block = encoder.encode([(":status", "200"), ("content-type", "application/grpc")])
    return frames.frame(FrameType.HEADERS, Flag.END_HEADERS, stream_id, block)


def messages(stream_id: int, count: int, size: int) -> list[bytes]:
    """``count`` DATA frames of one ``size``-byte message each."""
    return [
        frames.frame(FrameType.DATA, 0, stream_id, grpc_wire.message(bytes([i % 251]) * size))
        for i in range(count)
    ]


class Server:
    """A server's side of one stream's flow control: it sends one-message DATA frames while
    the window the client gave it allows."""

    def __init__(self, protocol: ClientProtocol, stream: Stream, size: int) -> None:
        self.protocol, self.stream, self.size = protocol, stream, size
        self.per_frame = size + grpc_wire.MESSAGE_PREFIX_BYTES
        self.window = STREAM_WINDOW
        self.sent = 0

    def send_while_allowed(self) -> None:
        while self.window >= self.per_frame and self.stream.code is None:
            self.protocol.receive(messages(1, 1, self.size)[0])
            self.window -= self.per_frame
            self.sent += self.per_frame
            self.take_updates()

    def take_updates(self) -> None:
        self.window += window_updates(self.protocol.data_to_send()).get(1, 0)


def read_all(protocol: ClientProtocol, stream: Stream) -> list[bytes]:
    """Every complete message ``stream`` holds, taken as the call's reader takes them."""
    taken = []
    while stream.unread:
        taken.append(protocol.take(stream))
    return taken


def streaming_call(protocol: ClientProtocol) -> Stream:
    stream = Stream(streaming=True)
    protocol.open(stream, PATH, b"go", timeout_s=30)
    protocol.data_to_send()
    protocol.receive(answer_headers(1, hpack.Encoder()))
    return stream


def test_a_streaming_call_read_slowly_holds_the_server_to_its_window() -> None:
    protocol = settled()
    stream = streaming_call(protocol)
    server = Server(protocol, stream, size=8_000)
    server.send_while_allowed()
    # Nothing was read: the server is blocked, the client holds its unread messages, at most
    # half a window past which no window is given back, plus the window then open.
    assert server.window < server.per_frame
    assert STREAM_WINDOW <= stream.held_bytes <= STREAM_WINDOW * 3 // 2
    assert stream.code is None
    # One more frame than the window: a stream error, the connection goes on.
    events = protocol.receive(messages(1, 1, server.size)[0])
    assert stream.code is grpc.StatusCode.INTERNAL
    assert "left in its window (FLOW_CONTROL_ERROR)" in stream.details
    assert [e.violation for e in events if isinstance(e, Breach)] == [Violation.FLOW_CONTROL]
    assert (FrameType.RST_STREAM, 0, 1, struct.pack(">L", ErrorCode.FLOW_CONTROL_ERROR)) in parsed(
        protocol.data_to_send()
    )
    assert protocol.usable


def test_reading_opens_the_streams_window_again() -> None:
    protocol = settled()
    stream = streaming_call(protocol)
    server = Server(protocol, stream, size=8_000)
    for _ in range(5):  # fill, read all, fill again...
        server.send_while_allowed()
        assert server.window < server.per_frame
        while stream.unread:
            protocol.take(stream)
            server.take_updates()
        assert server.window >= STREAM_WINDOW * 3 // 4  # all but the last batch given back
    assert stream.code is None
    assert server.sent > 5 * STREAM_WINDOW


@pytest.mark.parametrize("frame_sizes", [(1, 40), (2_000, 6_000)])
def test_messages_come_out_whole_and_in_order_however_frames_cut_them(
    frame_sizes: tuple[int, int],
) -> None:
    """Messages of 0 to 300 bytes, their bytes cut into frames of ``frame_sizes`` (a message
    across frames, several in one), the reader taking one after some frames and the rest at
    the end: each comes out whole, as ``bytes``, in order, and the stream then holds nothing."""
    protocol = settled()
    stream = streaming_call(protocol)
    payloads = [bytes([i % 251]) * (i * 37 % 301) for i in range(300)]
    wire = b"".join(grpc_wire.message(payload) for payload in payloads)
    low, high = frame_sizes
    taken: list[bytes] = []
    offset = step = 0
    while offset < len(wire):
        size = low + step * 7919 % (high - low + 1)
        protocol.receive(frames.frame(FrameType.DATA, 0, 1, wire[offset : offset + size]))
        protocol.data_to_send()
        offset += size
        step += 1
        if step % 3 and stream.unread:
            taken.append(protocol.take(stream))
    taken += read_all(protocol, stream)
    assert taken == payloads
    assert all(type(message) is bytes for message in taken)
    assert stream.held_bytes == 0 and stream.code is None


def test_a_unary_answer_gives_its_window_back_as_it_arrives_and_has_one_message() -> None:
    protocol = settled()
    stream = Stream(streaming=False)
    protocol.open(stream, PATH, b"go", timeout_s=None)
    protocol.data_to_send()
    protocol.receive(answer_headers(1, hpack.Encoder()))
    big = grpc_wire.message(bytes(3 * STREAM_WINDOW))  # larger than the stream's window
    for offset in range(0, len(big), frames.DEFAULT_MAX_FRAME):
        chunk = big[offset : offset + frames.DEFAULT_MAX_FRAME]
        protocol.receive(frames.frame(FrameType.DATA, 0, 1, chunk))
        protocol.data_to_send()
    assert stream.code is None and stream.unread == 1
    protocol.receive(messages(1, 1, 10)[0])
    assert stream.code is grpc.StatusCode.INTERNAL
    assert "had 2 messages" in stream.details


def test_a_request_over_the_servers_window_goes_as_the_window_opens() -> None:
    protocol = settled({Setting.INITIAL_WINDOW_SIZE: 1024})
    stream = Stream(streaming=False)
    payload = bytes(100_000)
    protocol.open(stream, PATH, payload, timeout_s=None)
    sent = parsed(protocol.data_to_send())
    assert [kind for kind, *_ in sent] == [FrameType.HEADERS, FrameType.DATA]
    assert len(sent[1][3]) == 1024 and not sent[1][1] & Flag.END_STREAM
    assert stream.held_bytes == len(payload) + grpc_wire.MESSAGE_PREFIX_BYTES - 1024
    protocol.receive(frames.window_update(1, 200_000))
    sent = parsed(protocol.data_to_send())
    # The connection's window (65,535 at first) is the limit now.
    assert sum(len(p) for *_, p in sent) == frames.DEFAULT_WINDOW - 1024
    protocol.receive(frames.window_update(0, 200_000))
    sent = parsed(protocol.data_to_send())
    assert sent[-1][1] & Flag.END_STREAM
    assert stream.held_bytes == 0


def test_refused_before_an_answer_and_above_a_goaway_are_safe_to_send_again() -> None:
    protocol = settled()
    refused, answered, above = (Stream(streaming=True) for _ in range(3))
    for stream in (refused, answered, above):
        protocol.open(stream, PATH, b"x", timeout_s=None)
    protocol.receive(answer_headers(3, hpack.Encoder()))
    refusal = struct.pack(">L", ErrorCode.REFUSED_STREAM)
    protocol.receive(frames.frame(FrameType.RST_STREAM, 0, 1, refusal))
    assert refused.code is grpc.StatusCode.UNAVAILABLE
    assert refused.unprocessed == "refused_stream"
    protocol.receive(frames.goaway(3, ErrorCode.NO_ERROR))
    assert above.code is grpc.StatusCode.UNAVAILABLE and above.unprocessed == "goaway"
    assert answered.code is None  # taken: it finishes on this connection
    assert not protocol.usable
    protocol.receive(frames.frame(FrameType.RST_STREAM, 0, 3, refusal))
    assert answered.code is grpc.StatusCode.UNAVAILABLE
    assert answered.unprocessed == ""  # it had an answer already: maybe processed


def test_a_truncated_goaway_ends_the_connection_and_never_raises() -> None:
    protocol = settled()
    stream = Stream(streaming=False)
    protocol.open(stream, PATH, b"x", timeout_s=None)
    protocol.data_to_send()
    events = protocol.receive(frames.frame(FrameType.GOAWAY, 0, 0, b"\x00\x00\x00\x01"))
    assert kinds(events)[-1] is ConnectionEnded
    assert [e.violation for e in events if isinstance(e, Breach)] == [Violation.FRAME_SIZE]
    assert stream.code is grpc.StatusCode.UNAVAILABLE
    assert "GOAWAY frame of 4 bytes" in stream.details
    goaway = parsed(protocol.data_to_send())[-1]
    assert goaway[0] == FrameType.GOAWAY
    assert struct.unpack_from(">LL", goaway[3]) == (0, ErrorCode.FRAME_SIZE_ERROR)
    assert protocol.receive(frames.SETTINGS_ACK) == []  # nothing more is read


def test_data_past_the_connections_window_is_a_connection_error() -> None:
    protocol = settled()
    stream = Stream(streaming=False)
    protocol.open(stream, PATH, b"x", timeout_s=None)
    protocol._receive_window = 10  # what is left of it
    events = protocol.receive(frames.frame(FrameType.DATA, 0, 1, bytes(11)))
    assert kinds(events)[-1] is ConnectionEnded
    assert stream.code is grpc.StatusCode.UNAVAILABLE
    assert "connection's window (FLOW_CONTROL_ERROR)" in stream.details


def test_a_settings_ack_timeout_is_a_connection_error_the_io_layer_raises() -> None:
    protocol = ClientProtocol("engine:1", authority=b"e", tls=False, max_message_bytes=1024)
    protocol.receive(frames.settings({}))
    stream = Stream(streaming=False)
    protocol.open(stream, PATH, b"x", timeout_s=None)
    protocol.data_to_send()
    events = protocol.fail(
        ProtocolError(Violation.SETTINGS_TIMEOUT, ErrorCode.SETTINGS_TIMEOUT, "did not acknowledge")
    )
    assert [e.violation for e in events if isinstance(e, Breach)] == [Violation.SETTINGS_TIMEOUT]
    assert stream.code is grpc.StatusCode.UNAVAILABLE
    goaway = parsed(protocol.data_to_send())[-1]
    assert struct.unpack_from(">LL", goaway[3]) == (0, ErrorCode.SETTINGS_TIMEOUT)


HTTP2_MODULES = ("frames", "rules", "hpack_decoder", "header_blocks", "http2_events", "http2_base")


def test_the_http2_layer_imports_nothing_of_grpc() -> None:
    """The gRPC layer builds on HTTP/2's modules, never the reverse: none of them imports the
    ``grpc`` package, gRPC's wire pieces or the protocol above (``errors`` is the package's
    shared error tree, imported by both)."""
    package = Path(frames.__file__).parent
    for name in (*HTTP2_MODULES, "http2"):
        imported: set[str] = set()
        for node in ast.walk(ast.parse((package / f"{name}.py").read_text())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        grpc_side = {
            module
            for module in imported
            if module.split(".")[0] == "grpc"
            or module.endswith((".grpc_wire", ".protocol", ".call", ".channel", ".connection"))
        }
        assert not grpc_side, f"{name}.py imports {sorted(grpc_side)}"
