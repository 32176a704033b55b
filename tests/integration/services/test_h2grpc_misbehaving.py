"""The h2grpc channel against a server that breaks HTTP/2 (``misbehaving_h2``): each breach
ends the call with a status and a message naming it, the client answers as RFC 9113 says
(GOAWAY for a connection error, RST_STREAM for a stream error, with the error's code), the
breach is counted, and the same channel serves the next call (on a new connection after a
connection error, on the same one after a stream error). Meanwhile and afterwards a second
channel, to a conforming grpc.aio server, is served: the router goes on serving its other
engines. Real sockets, the real client."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest
from h2.settings import SettingCodes
from prometheus_client import CollectorRegistry

from services.control_plane.wire import EngineRecord, EngineRole
from services.engines.requests import SamplingParams
from services.router.metrics import RouterMetrics
from services.router.scheduling.connector import GrpcConnectorFactory
from services.serving import h2grpc
from services.serving.errors import EngineUnreachable
from services.serving.h2grpc import CallFailed, H2GrpcChannel
from services.serving.h2grpc.errors import Violation
from services.serving.h2grpc.frames import DEFAULT_MAX_FRAME, MAX_HEADER_LIST_SIZE, ErrorCode
from services.serving.h2grpc.hpack_decoder import HpackDecoder
from services.topology import ModelShape
from tests.integration.services import misbehaving_h2
from tests.integration.services.misbehaving_h2 import Behaviour, MisbehavingServer

pytestmark = pytest.mark.integration

CALL_BOUND_S = 30.0
"""Outer bound of every await; reaching it is a hang and fails the test."""
DEADLINE_BOUND_S = 10.0
"""Bound of a call whose deadline (or the client's own timer) is at most 1 s: it ends well within
it however loaded the machine; one that reaches it was not ended by that deadline (the client's
keepalive, 10 + 5 s, would have ended it later)."""

ECHO = b"/test.Echo/Echo"
MAX_MESSAGE_BYTES = 1 << 20

T = TypeVar("T")


@dataclass(frozen=True)
class Breach:
    behaviour: Behaviour
    code: grpc.StatusCode
    details: str
    """A part of the call's details."""
    violation: str | None
    """Its count's label (None: not a breach, nothing counted)."""
    goaway: ErrorCode | None = None
    """A connection error: the GOAWAY's code. Otherwise a stream error, answered with:"""
    reset: ErrorCode | None = None


BREACHES = {
    "truncated GOAWAY": Breach(
        misbehaving_h2.truncated_goaway,
        grpc.StatusCode.UNAVAILABLE,
        "sent a GOAWAY frame of 4 bytes (expected at least 8) (FRAME_SIZE_ERROR)",
        Violation.FRAME_SIZE,
        goaway=ErrorCode.FRAME_SIZE_ERROR,
    ),
    "SETTINGS not a multiple of 6": Breach(
        misbehaving_h2.settings_of_seven_bytes,
        grpc.StatusCode.UNAVAILABLE,
        "sent a SETTINGS frame of 7 bytes (expected a multiple of 6) (FRAME_SIZE_ERROR)",
        Violation.FRAME_SIZE,
        goaway=ErrorCode.FRAME_SIZE_ERROR,
    ),
    "WINDOW_UPDATE 0 on the connection": Breach(
        misbehaving_h2.zero_window_update_on_the_connection,
        grpc.StatusCode.UNAVAILABLE,
        "sent a WINDOW_UPDATE of 0 on the connection (PROTOCOL_ERROR)",
        Violation.WINDOW_UPDATE_ZERO,
        goaway=ErrorCode.PROTOCOL_ERROR,
    ),
    "WINDOW_UPDATE 0 on the stream": Breach(
        misbehaving_h2.zero_window_update_on_the_stream,
        grpc.StatusCode.INTERNAL,
        "sent a WINDOW_UPDATE of 0 on stream 1 (PROTOCOL_ERROR)",
        Violation.WINDOW_UPDATE_ZERO,
        reset=ErrorCode.PROTOCOL_ERROR,
    ),
    "window overflow on the connection": Breach(
        misbehaving_h2.window_overflow_on_the_connection,
        grpc.StatusCode.UNAVAILABLE,
        "past 2^31-1 (FLOW_CONTROL_ERROR)",
        Violation.WINDOW_OVERFLOW,
        goaway=ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "window overflow on the stream": Breach(
        misbehaving_h2.window_overflow_on_the_stream,
        grpc.StatusCode.INTERNAL,
        "on stream 1, taking its window of",
        Violation.WINDOW_OVERFLOW,
        reset=ErrorCode.FLOW_CONTROL_ERROR,
    ),
    "frame over the max frame size": Breach(
        misbehaving_h2.oversized_data_frame,
        grpc.StatusCode.UNAVAILABLE,
        "sent a DATA frame of 20000 bytes, over the 16384 advertised (SETTINGS_MAX_FRAME_SIZE) "
        "(FRAME_SIZE_ERROR)",
        Violation.FRAME_SIZE,
        goaway=ErrorCode.FRAME_SIZE_ERROR,
    ),
    "header list over the max": Breach(
        misbehaving_h2.huge_header_list,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        f"over the {MAX_HEADER_LIST_SIZE} advertised (SETTINGS_MAX_HEADER_LIST_SIZE)",
        Violation.HEADER_LIST_SIZE,
        reset=ErrorCode.CANCEL,
    ),
    "compressed message": Breach(
        misbehaving_h2.compressed_message,
        grpc.StatusCode.INTERNAL,
        "compressed gRPC messages are not supported",
        Violation.COMPRESSED_MESSAGE,
        reset=ErrorCode.CANCEL,
    ),
    "binary metadata not base64": Breach(
        misbehaving_h2.binary_metadata_not_base64,
        grpc.StatusCode.INTERNAL,
        "sent binary metadata x-blob-bin that is not base64",
        Violation.MALFORMED,
    ),
    "DATA on a stream never opened": Breach(
        misbehaving_h2.data_on_a_stream_never_opened,
        grpc.StatusCode.UNAVAILABLE,
        "sent DATA on stream 3, which the client never opened (PROTOCOL_ERROR)",
        Violation.MALFORMED,
        goaway=ErrorCode.PROTOCOL_ERROR,
    ),
    "grpc-status not ASCII digits": Breach(
        misbehaving_h2.grpc_status_superscript,
        grpc.StatusCode.INTERNAL,
        "sent a malformed grpc-status '²' (not a decimal number)",
        Violation.MALFORMED,
    ),
    "grpc-status of 5,000 digits": Breach(
        misbehaving_h2.grpc_status_of_5000_digits,
        grpc.StatusCode.INTERNAL,
        "sent a malformed grpc-status '9999999999999999999999999999999999999999' (5000 characters)",
        Violation.MALFORMED,
    ),
    "grpc-status a word, no grpc-message": Breach(
        misbehaving_h2.grpc_status_a_word_without_message,
        grpc.StatusCode.INTERNAL,
        "sent a malformed grpc-status 'OK'",
        Violation.MALFORMED,
    ),
    ":status not ASCII digits": Breach(
        misbehaving_h2.http_status_superscript,
        grpc.StatusCode.INTERNAL,
        "sent a malformed :status '²00' (not 3 ASCII digits)",
        Violation.MALFORMED,
        reset=ErrorCode.PROTOCOL_ERROR,
    ),
    "an HTML page with HTTP 200": Breach(
        misbehaving_h2.html_200,
        grpc.StatusCode.UNKNOWN,
        "answered HTTP 200 with content-type 'text/html', not application/grpc",
        None,
        reset=ErrorCode.PROTOCOL_ERROR,
    ),
}
"""REFUSED_STREAM is not a breach, and is retried: see test_refused_stream_*. What a server may
do within the grammar but not to the client's memory or time (empty CONTINUATIONs, empty
messages, PING floods, no SETTINGS): test_h2grpc_misbehaving_bounds.py."""


@dataclass
class Stage:
    """A misbehaving server, a channel to it and what the channel counted; another engine."""

    server: MisbehavingServer
    channel: H2GrpcChannel
    counted: list[str]
    """The breaches the channel counted (``on_protocol_error``)."""
    other: H2GrpcChannel | None
    """A channel to a conforming grpc.aio echo server: another engine of the router's."""
    retries: list[str] = field(default_factory=list)
    """The calls the channel retried (``on_retry``), with ``count_retries``."""

    async def beside(self, work: Awaitable[T]) -> T:
        """``work``'s outcome, awaited while the other engine serves calls (one at least,
        then one every 10 ms until ``work`` is done)."""
        task = asyncio.ensure_future(work)
        try:
            while True:
                await self.other_serves()
                if task.done():
                    return task.result()
                await asyncio.wait({task}, timeout=0.01)
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def other_serves(self) -> None:
        assert self.other is not None
        assert await self.other.unary(ECHO, b"other", timeout_s=CALL_BOUND_S) == b"other"


@contextlib.asynccontextmanager
async def misbehaving(
    behaviours: list[Behaviour],
    *,
    other_engine: bool = True,
    settings: dict[SettingCodes, int] | None = None,
    ack_settings: bool = True,
    read_after_request: bool = True,
    count_retries: bool = False,
    **channel_options: Any,
) -> AsyncIterator[Stage]:
    """A :class:`MisbehavingServer` with ``behaviours`` (and its options ``settings``,
    ``ack_settings``, ``read_after_request``), an :class:`H2GrpcChannel` to it (with
    ``channel_options``, and ``on_retry`` with ``count_retries``), and (``other_engine``) a
    channel to a grpc.aio echo server, which must serve afterwards; all closed afterwards."""
    server = MisbehavingServer(
        behaviours,
        settings=settings or {},
        ack_settings=ack_settings,
        read_after_request=read_after_request,
    )
    port = await server.start()
    counted: list[str] = []
    retries: list[str] = []
    if count_retries:
        channel_options["on_retry"] = retries.append
    channel = H2GrpcChannel(
        f"127.0.0.1:{port}",
        max_message_bytes=MAX_MESSAGE_BYTES,
        on_protocol_error=counted.append,
        **channel_options,
    )
    grpc_server, other = None, None
    if other_engine:
        grpc_server = _echo_server()
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        other = H2GrpcChannel(f"127.0.0.1:{grpc_port}", max_message_bytes=MAX_MESSAGE_BYTES)
    stage = Stage(server, channel, counted, other, retries)
    try:
        yield stage
        assert not server.errors, server.errors  # the server's own failures
        assert not server.rejected, server.rejected  # the client's frames h2 rejected
        if other is not None:
            async with asyncio.timeout(CALL_BOUND_S):
                await stage.other_serves()
    finally:
        await channel.close()
        await server.close()
        if other is not None and grpc_server is not None:
            await other.close()
            await grpc_server.stop(None)


@pytest.mark.parametrize("name", list(BREACHES))
async def test_a_breach_ends_its_call_as_rfc_9113_says_and_the_channel_goes_on(name: str) -> None:
    breach = BREACHES[name]
    async with misbehaving([breach.behaviour]) as stage:
        server, channel, counted = stage.server, stage.channel, stage.counted
        async with asyncio.timeout(CALL_BOUND_S):
            with pytest.raises(CallFailed) as failed:
                await stage.beside(channel.unary(ECHO, b"hello", timeout_s=CALL_BOUND_S))
            assert failed.value.code is breach.code, failed.value.details
            assert breach.details in failed.value.details
            if breach.goaway is not None:
                await server.wait_for(lambda: bool(server.goaways))
                assert server.goaways[0][0] == breach.goaway
            if breach.reset is not None:
                await server.wait_for(lambda: bool(server.resets))
                assert server.resets == [(1, breach.reset)]
            # The next call is served: on a new connection after a connection error (and on
            # the same one after a stream error: its HPACK state still the server's).
            assert await channel.unary(ECHO, b"again", timeout_s=CALL_BOUND_S) == b"again"
        assert server.connections == (2 if breach.goaway is not None else 1)
        assert counted == ([breach.violation] if breach.violation else [])
        if breach.goaway is None:
            assert not server.goaways


async def test_endless_continuation_is_cut_at_the_header_list_bound() -> None:
    held = 0
    async with misbehaving([misbehaving_h2.endless_continuation]) as stage:
        server, channel, counted = stage.server, stage.channel, stage.counted
        async with asyncio.timeout(CALL_BOUND_S):
            call = asyncio.create_task(channel.unary(ECHO, b"hello", timeout_s=CALL_BOUND_S))
            served = asyncio.create_task(stage.beside(call))
            while not call.done():
                held = max(held, channel.buffered_bytes())  # what it holds between reads
                await asyncio.sleep(0)
            with pytest.raises(CallFailed) as failed:
                await served
            assert failed.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"header block of over {MAX_HEADER_LIST_SIZE} bytes" in failed.value.details
            assert held <= MAX_HEADER_LIST_SIZE + DEFAULT_MAX_FRAME  # and one unread frame
            assert server.continuation_bytes > MAX_HEADER_LIST_SIZE  # the bound was reached
            assert await channel.unary(ECHO, b"again", timeout_s=CALL_BOUND_S) == b"again"
        assert counted == [Violation.HEADER_LIST_SIZE]
        assert server.connections == 2


async def test_goaway_mid_stream_lets_the_taken_call_end_the_next_goes_to_a_new_connection() -> (
    None
):
    """GOAWAY (NO_ERROR, last stream the streaming call's) after its first message: the call
    gets every message and OK, nothing is retried, the client closes that connection once the
    call ended, and the next call goes to a new one."""
    async with misbehaving([misbehaving_h2.goaway_mid_stream], count_retries=True) as stage:
        server, channel = stage.server, stage.channel

        async def read_all() -> list[bytes]:
            stream = channel.server_stream(ECHO, b"hello", timeout_s=CALL_BOUND_S)
            return [message async for message in stream]

        async with asyncio.timeout(CALL_BOUND_S):
            assert await stage.beside(read_all()) == misbehaving_h2.stream_of(b"hello")
            await server.wait_for(lambda: server.closed_by_client == 1)  # before any other call
            assert server.connections == 1
            assert await stage.beside(channel.unary(ECHO, b"again", timeout_s=None)) == b"again"
        assert server.connections == 2
        assert stage.retries == []
        assert stage.counted == []


async def test_a_call_a_goaway_did_not_take_is_retried_once_on_a_new_connection() -> None:
    """GOAWAY (NO_ERROR) whose last stream is the one before the call's, nothing else on its
    stream: the server did not process it (RFC 9113 §6.8); the client retries it once, on a new
    connection, and the good answer there is the call's."""
    behaviours = [misbehaving_h2.good, misbehaving_h2.goaway_not_taken]
    async with misbehaving(behaviours, count_retries=True) as stage:
        server, channel = stage.server, stage.channel
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"first", timeout_s=CALL_BOUND_S) == b"first"
            call = channel.unary(ECHO, b"hello", timeout_s=CALL_BOUND_S)
            assert await stage.beside(call) == b"hello"
        assert stage.retries == ["goaway"]
        assert server.connections == 2
        assert server.requests == 3  # the call's request twice
        assert stage.counted == []


async def test_refused_stream_is_retried_once_on_a_new_connection() -> None:
    """RST_STREAM REFUSED_STREAM before any response headers: the server did not process the
    request (RFC 9113 §8.7); the client retries it once, on a new connection."""
    async with misbehaving([misbehaving_h2.refused_stream], count_retries=True) as stage:
        server, channel = stage.server, stage.channel
        async with asyncio.timeout(CALL_BOUND_S):
            call = channel.unary(ECHO, b"hello", timeout_s=CALL_BOUND_S)
            assert await stage.beside(call) == b"hello"
        assert stage.retries == ["refused_stream"]
        assert server.connections == 2
        assert stage.counted == []


async def test_refused_stream_twice_fails_the_call_unavailable_after_one_retry() -> None:
    behaviours: list[Behaviour] = [misbehaving_h2.refused_stream, misbehaving_h2.refused_stream]
    async with misbehaving(behaviours, count_retries=True) as stage:
        server, channel = stage.server, stage.channel
        async with asyncio.timeout(CALL_BOUND_S):
            with pytest.raises(CallFailed) as failed:
                await stage.beside(channel.unary(ECHO, b"hello", timeout_s=CALL_BOUND_S))
            assert failed.value.code is grpc.StatusCode.UNAVAILABLE, failed.value.details
            assert "REFUSED_STREAM" in failed.value.details
            assert "did not process the request" in failed.value.details
            assert stage.retries == ["refused_stream"]
            assert server.connections == 2
            assert await channel.unary(ECHO, b"again", timeout_s=CALL_BOUND_S) == b"again"
        assert stage.retries == ["refused_stream"]
        assert stage.counted == []


async def test_a_server_that_never_acks_settings_gets_goaway_settings_timeout() -> None:
    """The server sends its SETTINGS (calls start) but never ACKs the client's, and answers
    nothing: after ``settings_ack_timeout_s`` the connection is closed with GOAWAY
    SETTINGS_TIMEOUT (RFC 9113 §6.5.3) and its call fails UNAVAILABLE."""
    async with misbehaving(
        [misbehaving_h2.silent], ack_settings=False, settings_ack_timeout_s=0.5
    ) as stage:
        server, channel = stage.server, stage.channel
        async with asyncio.timeout(DEADLINE_BOUND_S):
            with pytest.raises(CallFailed) as failed:
                await stage.beside(channel.unary(ECHO, b"hello", timeout_s=CALL_BOUND_S))
        assert failed.value.code is grpc.StatusCode.UNAVAILABLE, failed.value.details
        assert "did not acknowledge" in failed.value.details
        assert "SETTINGS" in failed.value.details
        async with asyncio.timeout(CALL_BOUND_S):
            await server.wait_for(lambda: bool(server.goaways))
        assert server.goaways[0][0] == ErrorCode.SETTINGS_TIMEOUT
        assert stage.counted == [Violation.SETTINGS_TIMEOUT]


async def test_a_server_that_stops_reading_ends_the_call_at_its_deadline_its_request_held() -> None:
    """The server advertises SETTINGS_INITIAL_WINDOW_SIZE 1024, stops reading after the
    request's headers and never sends WINDOW_UPDATE: a 256 KiB request waits on send-side flow
    control, the bytes the channel holds stay within the request (and 64 KiB), the call fails
    DEADLINE_EXCEEDED at its deadline, and nothing is held afterwards."""
    request = bytes(256 << 10)
    held = 0
    async with misbehaving(
        [],
        settings={SettingCodes.INITIAL_WINDOW_SIZE: 1024},
        read_after_request=False,
    ) as stage:
        channel = stage.channel

        def sample() -> None:
            nonlocal held
            held = max(held, channel.buffered_bytes())

        call = channel.unary(ECHO, request, timeout_s=1.0)
        async with asyncio.timeout(DEADLINE_BOUND_S):
            with pytest.raises(CallFailed) as failed:
                await stage.beside(sampled(call, sample))
        assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, failed.value.details
        assert held <= len(request) + (64 << 10)
        assert channel.buffered_bytes() == 0


async def test_the_wait_for_a_stream_slot_ends_at_the_calls_deadline() -> None:
    """SETTINGS_MAX_CONCURRENT_STREAMS 1, its stream held by a streaming call the server never
    answers: a second call waits for a slot only until its deadline (DEADLINE_EXCEEDED while
    the first call is still open), and the slot serves again once the first call left."""
    async with misbehaving(
        [misbehaving_h2.hold], settings={SettingCodes.MAX_CONCURRENT_STREAMS: 1}
    ) as stage:
        server, channel = stage.server, stage.channel
        stream = channel.server_stream(ECHO, b"held", timeout_s=CALL_BOUND_S)
        first = asyncio.ensure_future(anext(stream))
        try:
            async with asyncio.timeout(CALL_BOUND_S):
                await server.wait_for(lambda: server.requests == 1)
            async with asyncio.timeout(DEADLINE_BOUND_S):
                with pytest.raises(CallFailed) as failed:
                    await stage.beside(channel.unary(ECHO, b"second", timeout_s=0.5))
            assert failed.value.code is grpc.StatusCode.DEADLINE_EXCEEDED, failed.value.details
            assert not first.done()  # the first call still holds the stream
        finally:
            first.cancel()
            await asyncio.gather(first, return_exceptions=True)
        async with asyncio.timeout(CALL_BOUND_S):
            await server.wait_for(lambda: (1, ErrorCode.CANCEL) in server.resets)
            assert await channel.unary(ECHO, b"again", timeout_s=CALL_BOUND_S) == b"again"
        assert server.connections == 1
        assert server.requests == 2  # the second call never reached the server


async def test_an_endless_stream_read_slowly_is_held_back_by_flow_control() -> None:
    """The server sends 1 KiB messages as fast as the client's windows let it and never ends the
    stream; the consumer reads one every 20 ms: the channel holds at most two stream windows and
    a message, the server is held at a send window of 0 (it sent about a window, not what it
    could), and leaving the stream resets it (CANCEL)."""
    misbehaving_bound = h2grpc.STREAM_WINDOW * 2 + MAX_MESSAGE_BYTES
    async with misbehaving([misbehaving_h2.endless_stream]) as stage:
        server, channel = stage.server, stage.channel
        stream = channel.server_stream(ECHO, b"endless", timeout_s=CALL_BOUND_S)

        async def read_slowly() -> None:
            for _ in range(100):
                assert len(await anext(stream)) == 1024
                assert channel.buffered_bytes() <= misbehaving_bound
                await asyncio.sleep(0.02)

        async with asyncio.timeout(CALL_BOUND_S):
            try:
                await stage.beside(read_slowly())
                await server.wait_for(lambda: server.send_window_waits > 0)
                assert server.data_bytes_sent <= 2 * h2grpc.STREAM_WINDOW + (64 << 10)
            finally:
                await stream.aclose()
            await server.wait_for(lambda: (1, ErrorCode.CANCEL) in server.resets)
        assert channel.buffered_bytes() == 0
        assert stage.counted == []


async def test_a_failure_of_the_client_itself_closes_the_connection_and_never_escapes(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The catch-all of data_received: a bug met while reading (here a decoder that fails,
    the one fault injected) is logged, fails the calls INTERNAL and sends GOAWAY
    INTERNAL_ERROR; nothing reaches the event loop's exception handler."""
    loop_errors: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    previous = loop.get_exception_handler()
    loop.set_exception_handler(lambda _, context: loop_errors.append(context))

    def broken(self: HpackDecoder, block: bytes) -> None:
        raise RuntimeError("a bug in the decoder")

    monkeypatch.setattr(HpackDecoder, "decode", broken)
    try:
        # No other engine: the broken decoder is every channel's.
        async with misbehaving([], other_engine=False) as stage:
            server, channel, counted = stage.server, stage.channel, stage.counted
            async with asyncio.timeout(CALL_BOUND_S):
                with pytest.raises(CallFailed) as failed:
                    await channel.unary(ECHO, b"hello", timeout_s=CALL_BOUND_S)
                await server.wait_for(lambda: bool(server.goaways))
            assert failed.value.code is grpc.StatusCode.INTERNAL
            assert "RuntimeError('a bug in the decoder')" in failed.value.details
            assert server.goaways[0][0] == ErrorCode.INTERNAL_ERROR
            assert counted == [Violation.INTERNAL]
            assert "a bug in the decoder" in caplog.text  # logged with its traceback
            assert not loop_errors
    finally:
        loop.set_exception_handler(previous)


async def test_a_grpc_server_is_served_while_another_breaks_the_protocol() -> None:
    """One engine's breach fails its own calls only: calls to a grpc.aio server, before and
    after, from the same loop, complete."""
    grpc_server = _echo_server()
    grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    bad = MisbehavingServer([misbehaving_h2.zero_window_update_on_the_connection])
    bad_port = await bad.start()
    bad_channel = H2GrpcChannel(f"127.0.0.1:{bad_port}", max_message_bytes=1 << 20)
    grpc_channel = H2GrpcChannel(f"127.0.0.1:{grpc_port}", max_message_bytes=1 << 20)
    try:
        async with asyncio.timeout(CALL_BOUND_S):
            assert await grpc_channel.unary(ECHO, b"before", timeout_s=None) == b"before"
            results = await asyncio.gather(
                bad_channel.unary(ECHO, b"x", timeout_s=None),
                grpc_channel.unary(ECHO, b"during", timeout_s=None),
                return_exceptions=True,
            )
            assert isinstance(results[0], CallFailed)
            assert results[0].code is grpc.StatusCode.UNAVAILABLE
            assert results[1] == b"during"
            assert await grpc_channel.unary(ECHO, b"after", timeout_s=None) == b"after"
    finally:
        await bad_channel.close()
        await grpc_channel.close()
        await bad.close()
        await grpc_server.stop(None)


async def test_a_grpc_server_that_compresses_fails_the_call_naming_its_encoding() -> None:
    """grpc.aio with a default compression compresses even for a client that accepts identity
    only: pdserve's engines set none, and one that did would get this clear error."""
    grpc_server = _echo_server(compression=grpc.Compression.Gzip)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    await grpc_server.start()
    counted: list[str] = []
    channel = H2GrpcChannel(
        f"127.0.0.1:{port}", max_message_bytes=1 << 20, on_protocol_error=counted.append
    )
    try:
        async with asyncio.timeout(CALL_BOUND_S):
            with pytest.raises(CallFailed) as failed:
                await channel.unary(ECHO, b"x" * 1000, timeout_s=None)
        assert failed.value.code is grpc.StatusCode.INTERNAL
        assert "compressed gRPC messages are not supported" in failed.value.details
        assert "grpc-encoding gzip" in failed.value.details
        assert counted == [Violation.COMPRESSED_MESSAGE]
    finally:
        await channel.close()
        await grpc_server.stop(None)


def _echo_server(compression: grpc.Compression | None = None) -> grpc.aio.Server:
    server = grpc.aio.server(compression=compression)
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(_echo)}
            ),
        )
    )
    return server


async def test_the_routers_connectors_count_an_engines_breaches_in_its_metrics() -> None:
    """The router's wiring: GrpcConnectorFactory hands RouterMetrics' counters to the client."""
    metrics = RouterMetrics(CollectorRegistry())
    refused = misbehaving_h2.refused_stream
    server = MisbehavingServer(
        [misbehaving_h2.zero_window_update_on_the_connection, refused, refused]
    )
    port = await server.start()
    connector = GrpcConnectorFactory(
        on_protocol_error=metrics.engine_protocol_error, on_retry=metrics.engine_call_retry
    ).connect(
        EngineRecord(
            engine_id="prefill-0",
            generation=1,
            role=EngineRole.PREFILL,
            model="m",
            compat_hash="h",
            shape=ModelShape(num_layers=1, num_kv_heads=1, block_size=16),
            endpoint=f"127.0.0.1:{port}",
            pp_aware=False,
            lease_ttl_ms=1000,
            registered_at_ms=0,
        )
    )
    try:
        async with asyncio.timeout(CALL_BOUND_S):
            with pytest.raises(EngineUnreachable, match="sent a WINDOW_UPDATE of 0"):
                await connector.prefill(
                    "r-1", (1, 2, 3), SamplingParams(max_tokens=1), timeout_s=CALL_BOUND_S
                )
        counted = metrics.registry.get_sample_value(
            "pdserve_router_engine_protocol_errors_total", {"error": "window_update_zero"}
        )
        assert counted == 1
        async with asyncio.timeout(CALL_BOUND_S):
            with pytest.raises(EngineUnreachable, match="REFUSED_STREAM"):
                await connector.prefill(
                    "r-2", (1, 2, 3), SamplingParams(max_tokens=1), timeout_s=CALL_BOUND_S
                )
        retried = metrics.registry.get_sample_value(
            "pdserve_router_engine_call_retries_total", {"reason": "refused_stream"}
        )
        assert retried == 1
    finally:
        await connector.close()
        await server.close()


async def _echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    return request


async def sampled(work: Awaitable[T], sample: Callable[[], None]) -> T:
    """``work``'s outcome, ``sample()`` called every 10 ms until it is done."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            sample()
            await asyncio.wait({task}, timeout=0.01)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


async def test_calls_waiting_for_a_stream_move_on_when_their_connection_is_set_aside() -> None:
    """One stream at a time (MAX_CONCURRENT_STREAMS 1): the first call is refused, so the
    channel retries it on a new connection and sets the first aside. The calls that waited
    there for a stream were never sent: they start on the new connection, not fail
    UNAVAILABLE "going away" (the full suite saw 20 of 24 calls fail so under load)."""
    settings = {SettingCodes.MAX_CONCURRENT_STREAMS: 1}
    async with misbehaving(
        [misbehaving_h2.refused_stream], settings=settings, count_retries=True
    ) as stage:
        server, channel = stage.server, stage.channel
        async with asyncio.timeout(CALL_BOUND_S):
            payloads = [b"call %d" % i for i in range(4)]
            calls = asyncio.gather(
                *(channel.unary(ECHO, p, timeout_s=CALL_BOUND_S) for p in payloads)
            )
            assert await stage.beside(calls) == payloads
        assert stage.retries == ["refused_stream"]
        assert server.connections == 2
        assert stage.counted == []
