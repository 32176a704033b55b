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
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from services.control_plane.wire import EngineRecord, EngineRole
from services.engines.backend import SamplingParams
from services.router.metrics import RouterMetrics
from services.router.scheduling.connector import GrpcConnectorFactory
from services.serving.errors import EngineUnreachable
from services.serving.h2grpc import CallFailed, H2GrpcChannel
from services.serving.h2grpc.errors import Violation
from services.serving.h2grpc.frames import DEFAULT_MAX_FRAME, MAX_HEADER_LIST_SIZE, ErrorCode
from services.serving.h2grpc.hpack_decoder import HpackDecoder
from tests.integration.services import misbehaving_h2
from tests.integration.services.misbehaving_h2 import Behaviour, MisbehavingServer

pytestmark = pytest.mark.integration

CALL_BOUND_S = 30.0
"""Outer bound of every await; reaching it is a hang and fails the test."""

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
}


@dataclass
class Stage:
    """A misbehaving server, a channel to it and what the channel counted; another engine."""

    server: MisbehavingServer
    channel: H2GrpcChannel
    counted: list[str]
    """The breaches the channel counted (``on_protocol_error``)."""
    other: H2GrpcChannel | None
    """A channel to a conforming grpc.aio echo server: another engine of the router's."""

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
    retried: list[str] | None = None,
    *,
    other_engine: bool = True,
) -> AsyncIterator[Stage]:
    """A :class:`MisbehavingServer` with ``behaviours``, an :class:`H2GrpcChannel` to it (its
    retries go to ``retried``), and (``other_engine``) a channel to a grpc.aio echo server, which
    must serve afterwards; all closed afterwards."""
    server = MisbehavingServer(behaviours)
    port = await server.start()
    counted: list[str] = []
    channel = H2GrpcChannel(
        f"127.0.0.1:{port}",
        max_message_bytes=MAX_MESSAGE_BYTES,
        on_protocol_error=counted.append,
        on_retry=retried.append if retried is not None else None,
    )
    grpc_server, other = None, None
    if other_engine:
        grpc_server = _echo_server()
        grpc_port = grpc_server.add_insecure_port("127.0.0.1:0")
        await grpc_server.start()
        other = H2GrpcChannel(f"127.0.0.1:{grpc_port}", max_message_bytes=MAX_MESSAGE_BYTES)
    stage = Stage(server, channel, counted, other)
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


async def test_a_refused_stream_is_sent_once_more_on_a_fresh_connection() -> None:
    retried: list[str] = []
    refused, good = misbehaving_h2.refused_stream, misbehaving_h2.good
    behaviours = [refused, good, refused, refused]
    async with misbehaving(behaviours, retried) as stage:
        server, channel, counted = stage.server, stage.channel, stage.counted
        async with asyncio.timeout(CALL_BOUND_S):
            assert await channel.unary(ECHO, b"once", timeout_s=CALL_BOUND_S) == b"once"
            assert retried == ["refused_stream"]
            assert server.connections == 2
            with pytest.raises(CallFailed) as failed:  # refused on both connections
                await channel.unary(ECHO, b"twice", timeout_s=CALL_BOUND_S)
            assert failed.value.code is grpc.StatusCode.UNAVAILABLE
            assert (
                "with REFUSED_STREAM (HTTP/2 error 7): the server did not process the request"
                in failed.value.details
            )
            assert retried == ["refused_stream"] * 2
            assert server.connections == 3
        assert counted == []


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
            pp_size=1,
            tp_size=1,
            num_layers=1,
            num_kv_heads=1,
            block_size=16,
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
