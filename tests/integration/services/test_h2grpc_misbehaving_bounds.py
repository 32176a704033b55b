"""The h2grpc channel against a server that stays within HTTP/2's grammar but not within the
client's time or memory (issue 46): endless empty CONTINUATIONs, empty messages, a flood of PINGs
whose answers it never reads, a server that accepts TCP and never speaks HTTP/2. Each ends its
call with a status naming what the server did, within its bound (no call waits for keepalive
or its own deadline), what the channel holds stays bounded (``buffered_bytes``: unread
messages at what they cost, a header block, the transport's write buffer), and the same channel
serves the next call. Real sockets, the real client; the server is ``misbehaving_h2``'s."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from services.serving.h2grpc import CallFailed
from services.serving.h2grpc.errors import Violation
from services.serving.h2grpc.frames import DEFAULT_MAX_FRAME, MAX_HEADER_LIST_SIZE, ErrorCode
from services.serving.h2grpc.http2_base import MAX_UNWRITTEN_REPLIES, STREAM_WINDOW
from services.serving.h2grpc.protocol import MAX_QUEUED_COST, MESSAGE_COST
from tests.integration.services import misbehaving_h2
from tests.integration.services.test_h2grpc_misbehaving import (
    CALL_BOUND_S,
    DEADLINE_BOUND_S,
    ECHO,
    misbehaving,
    sampled,
)

pytestmark = pytest.mark.integration

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


async def test_endless_empty_messages_unread_fail_the_call_at_its_memory_bound() -> None:
    """Empty messages as fast as the windows let them go, the reader stopped after the first:
    each is charged what it costs, so the call fails RESOURCE_EXHAUSTED (reset ENHANCE_YOUR_CALM)
    within a window of them, its messages let go; the next call is served on the connection."""
    held = 0
    async with misbehaving([misbehaving_h2.endless_messages(0)]) as stage:
        server, channel = stage.server, stage.channel
        stream = channel.server_stream(ECHO, b"hello", timeout_s=CALL_BOUND_S)

        def sample() -> None:
            nonlocal held
            held = max(held, channel.buffered_bytes())

        try:
            async with asyncio.timeout(CALL_BOUND_S):
                assert await anext(stream) == b""
                reset = (1, ErrorCode.ENHANCE_YOUR_CALM)
                await stage.beside(sampled(server.wait_for(lambda: reset in server.resets), sample))
                assert channel.buffered_bytes() == 0  # its messages went with it
                with pytest.raises(CallFailed) as failed:
                    await anext(stream)
        finally:
            await stream.aclose()
        assert failed.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED, failed.value.details
        assert f"over the {MAX_QUEUED_COST} bound" in failed.value.details
        assert held <= MAX_QUEUED_COST + DEFAULT_MAX_FRAME // 5 * MESSAGE_COST
        assert server.data_bytes_sent <= STREAM_WINDOW + (64 << 10)
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"again", timeout_s=None) == b"again"
        assert stage.counted == [Violation.FLOOD]
        assert server.connections == 1


async def test_endless_small_messages_unread_hold_the_server_to_its_window() -> None:
    """8-byte messages, the reader stopped: the server is held at a send window of 0 after
    about a window, and the channel holds them at what they cost, within MAX_QUEUED_COST."""
    async with misbehaving([misbehaving_h2.endless_messages(8)]) as stage:
        server, channel = stage.server, stage.channel
        stream = channel.server_stream(ECHO, b"hello", timeout_s=CALL_BOUND_S)
        try:
            async with asyncio.timeout(CALL_BOUND_S):
                assert await anext(stream) == b"\x01" * 8
                await stage.beside(server.wait_for(lambda: server.send_window_waits > 0))
                assert server.data_bytes_sent <= STREAM_WINDOW * 5 // 4
                held = channel.buffered_bytes()
                assert held <= MAX_QUEUED_COST
                assert held >= server.data_bytes_sent // 13 * (8 + MESSAGE_COST) // 2
        finally:
            await stream.aclose()
        async with asyncio.timeout(CALL_BOUND_S):
            await server.wait_for(lambda: (1, ErrorCode.CANCEL) in server.resets)
        assert channel.buffered_bytes() == 0
        assert stage.counted == []


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
