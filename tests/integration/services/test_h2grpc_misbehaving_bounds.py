"""The h2grpc channel against a server that stays within HTTP/2's grammar but not within the
client's time or memory (issue 46): endless empty CONTINUATIONs, endless empty and tiny messages
to a reader that stopped, a flood of PINGs whose answers it never reads, a server that accepts
TCP and never speaks HTTP/2. Each ends its call with a status naming what the server did, within
its bound (no call waits for keepalive or its own deadline), or is held by the stream's window
(tiny messages), what the channel holds stays bounded (``buffered_bytes``: unread messages as
they came on the wire, a header block, the transport's write buffer), and the same channel
serves the next call. Real sockets, the real client; the server is ``misbehaving_h2``'s."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import grpc
import pytest

from services.serving import h2grpc
from services.serving.h2grpc import CallFailed
from services.serving.h2grpc.errors import Violation
from services.serving.h2grpc.frames import DEFAULT_MAX_FRAME, MAX_HEADER_LIST_SIZE, ErrorCode
from services.serving.h2grpc.http2_base import MAX_UNWRITTEN_REPLIES, STREAM_WINDOW
from tests.integration.services import misbehaving_h2
from tests.integration.services.test_h2grpc_misbehaving import (
    CALL_BOUND_S,
    DEADLINE_BOUND_S,
    ECHO,
    misbehaving,
    sampled,
)

pytestmark = pytest.mark.integration

H2GRPC_FILES = Path(h2grpc.__file__).parent / "*"
WRITE_BUFFER_BOUND = 256 << 10
"""What the transport may hold of the client's answers: its 64 KiB high-water mark, past which
it stops reading, and one read's answers (at most MAX_UNWRITTEN_REPLIES of them)."""


async def test_endless_empty_continuations_end_at_the_header_block_bound() -> None:
    """Empty CONTINUATIONs never grow the block's bytes: each frame's header is charged, so the
    connection ends after about 7,300 of them, not at keepalive (15 s) or the call's deadline."""
    held = 0

    async with misbehaving([misbehaving_h2.endless_empty_continuation]) as stage:
        server, channel = stage.server, stage.channel

        def sample() -> None:
            nonlocal held
            held = max(held, channel.buffered_bytes())

        async with asyncio.timeout(DEADLINE_BOUND_S):
            call = channel.unary(ECHO, b"hello", timeout_s=None)
            with pytest.raises(CallFailed) as failed:
                await stage.beside(sampled(call, sample))
        assert failed.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED, failed.value.details
        assert f"header block of over {MAX_HEADER_LIST_SIZE} bytes" in failed.value.details
        assert "CONTINUATION frames, 1 bytes of fields" in failed.value.details
        assert held <= MAX_HEADER_LIST_SIZE + DEFAULT_MAX_FRAME
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"again", timeout_s=None) == b"again"
        assert stage.counted == [Violation.HEADER_LIST_SIZE]
        assert server.connections == 2


async def test_one_empty_message_reaches_the_reader_at_once() -> None:
    """A default protobuf is 0 bytes: the reader is woken for it as for any message, not at
    the call's deadline."""
    async with misbehaving([misbehaving_h2.one_empty_message_then_hold]) as stage:
        channel = stage.channel
        stream = channel.server_stream(ECHO, b"hello", timeout_s=CALL_BOUND_S)
        try:
            async with asyncio.timeout(DEADLINE_BOUND_S):
                assert await stage.beside(anext(stream)) == b""
        finally:
            await stream.aclose()
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"again", timeout_s=None) == b"again"
        assert stage.counted == []


def h2grpc_allocated() -> int:
    """The bytes tracemalloc sees allocated, and not yet freed, by the h2grpc package's code."""
    snapshot = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(True, str(H2GRPC_FILES))]
    )
    return sum(stat.size for stat in snapshot.statistics("filename"))


@pytest.mark.parametrize("size", [0, 2, 5])
async def test_endless_tiny_messages_unread_are_held_at_the_window(size: int) -> None:
    """Messages of 0, 2 and 5 bytes (a token delta is about 10 bytes on the wire) as fast as
    the windows let them go, the reader stopped after the first: the server is held at a send
    window of 0 within a window and a half, the call not failed (issue 46 failed 0-2 bytes
    RESOURCE_EXHAUSTED at 8 MiB of Python objects, and held 6 MiB of 5-byte ones), and what
    the client holds is what came, as it came: the channel's buffered bytes, and the memory
    the h2grpc package allocated for them, near the window. Read on, the messages come; closed,
    the call is cancelled and let go."""
    one = 5 + size
    tracemalloc.start()
    try:
        async with misbehaving([misbehaving_h2.endless_messages(size)]) as stage:
            server, channel = stage.server, stage.channel
            stream = channel.server_stream(ECHO, b"hello", timeout_s=CALL_BOUND_S)
            try:
                async with asyncio.timeout(CALL_BOUND_S):
                    assert await anext(stream) == b"\x01" * size
                    before = h2grpc_allocated()
                    await stage.beside(server.wait_for(lambda: server.send_window_waits > 0))
                    # The client reads the last bytes sent (its window updates may let more in).
                    sent = server.data_bytes_sent
                    while channel.buffered_bytes() < sent - one:
                        await asyncio.sleep(0.01)
                        sent = server.data_bytes_sent
                    held = channel.buffered_bytes()
                    allocated = h2grpc_allocated() - before
                    assert STREAM_WINDOW <= server.data_bytes_sent <= STREAM_WINDOW * 3 // 2
                    # (The first message's bytes go with the rest of its frame's.)
                    assert server.data_bytes_sent - one <= held <= server.data_bytes_sent
                    assert allocated <= held * 1.15 + (64 << 10), (allocated, held)
                    for _ in range(10_000):
                        assert await anext(stream) == b"\x01" * size
            finally:
                await stream.aclose()
            async with asyncio.timeout(CALL_BOUND_S):
                await server.wait_for(lambda: (1, ErrorCode.CANCEL) in server.resets)
            assert channel.buffered_bytes() == 0
            assert stage.counted == []
    finally:
        tracemalloc.stop()


async def test_a_ping_flood_not_read_ends_with_enhance_your_calm() -> None:
    """The server stops reading and sends PINGs without end: their answers wait in the
    client's transport; past MAX_UNWRITTEN_REPLIES unwritten the connection ends (GOAWAY
    ENHANCE_YOUR_CALM), the call fails UNAVAILABLE naming it, what the channel held stayed
    within the transport's high-water mark and a read's answers, and a new connection serves."""
    held = 0
    async with misbehaving([misbehaving_h2.ping_flood]) as stage:
        server, channel = stage.server, stage.channel

        def sample() -> None:
            nonlocal held
            held = max(held, channel.buffered_bytes())

        async with asyncio.timeout(DEADLINE_BOUND_S):
            call = channel.unary(ECHO, b"hello", timeout_s=None)
            with pytest.raises(CallFailed) as failed:
                await stage.beside(sampled(call, sample))
        assert failed.value.code is grpc.StatusCode.UNAVAILABLE, failed.value.details
        assert f"sent over {MAX_UNWRITTEN_REPLIES} PINGs and SETTINGS" in failed.value.details
        assert "(ENHANCE_YOUR_CALM)" in failed.value.details
        assert held <= WRITE_BUFFER_BOUND
        assert server.pings_sent > MAX_UNWRITTEN_REPLIES
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"again", timeout_s=None) == b"again"
        assert stage.counted == [Violation.FLOOD]
        assert server.connections == 2


async def test_a_server_that_never_speaks_http2_fails_a_call_without_deadline() -> None:
    """TCP accepted, no SETTINGS ever: the handshake bound (not the call's deadline, which it
    has none of) fails the call UNAVAILABLE naming it; after the back-off the next connection
    serves."""
    async with misbehaving([], handshake_timeout_s=0.5, reconnect_backoff_s=0.01) as stage:
        server, channel = stage.server, stage.channel
        server.silent_connections = 1
        async with asyncio.timeout(DEADLINE_BOUND_S):
            with pytest.raises(CallFailed) as failed:
                await stage.beside(channel.unary(ECHO, b"hello", timeout_s=None))
        assert failed.value.code is grpc.StatusCode.UNAVAILABLE, failed.value.details
        assert "sent no HTTP/2 SETTINGS within 0.5 s (the handshake bound)" in failed.value.details
        assert stage.counted == [Violation.HANDSHAKE_TIMEOUT]
        await asyncio.sleep(0.1)  # the back-off (0.01 s, +-20%)
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"again", timeout_s=None) == b"again"
        assert server.connections == 2


async def test_a_calls_own_deadline_shorter_than_the_handshake_bound_is_its_own() -> None:
    async with misbehaving([], other_engine=False, handshake_timeout_s=30.0) as stage:
        server, channel = stage.server, stage.channel
        server.silent_connections = 1
        async with asyncio.timeout(DEADLINE_BOUND_S):
            with pytest.raises(CallFailed) as failed:
                await channel.unary(ECHO, b"hello", timeout_s=0.3)
        assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, failed.value.details
        assert stage.counted == []


async def test_a_connection_whose_writes_are_not_taken_stops_reading() -> None:
    """Writer backpressure: the transport's ``pause_writing`` (its buffer past the high-water
    mark) pauses reading the server, ``resume_writing`` resumes it, on the real transport."""
    async with misbehaving([], other_engine=False) as stage:
        channel = stage.channel
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"hello", timeout_s=None) == b"hello"
        connection = channel._connection
        assert connection is not None and connection._transport is not None
        transport = connection._transport
        assert transport.is_reading()
        connection.pause_writing()
        assert not transport.is_reading()
        connection.resume_writing()
        assert transport.is_reading()
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"again", timeout_s=None) == b"again"
