"""The h2grpc channel against real ``grpc.aio`` servers: messages larger than a frame and than
the server's windows both ways, more calls than the server's concurrent streams, statuses with
metadata and percent-encoded details, deadlines and cancellations that reach the server, a
refused connection, a server that stops (GOAWAY) and a new one on the same port, a message over
the client's bound, and a frozen server found by the keepalive ping."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import grpc.aio
import pytest
import uvloop

from services.serving.h2grpc import CallFailed, H2GrpcChannel
from services.serving.h2grpc.channel import RECONNECT_JITTER, RECONNECT_MAX_BACKOFF_S

pytestmark = pytest.mark.integration

CALL_BOUND_S = 60.0
"""Outer bound of every await; reaching it is a hang and fails the test."""

ECHO = b"/test.Echo/Echo"
STREAM = b"/test.Echo/Stream"
FAIL = b"/test.Echo/Fail"
SLOW = b"/test.Echo/Slow"


class EchoService:
    """Bytes in, bytes out (no protobuf: the channel carries serialized messages)."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        # b"N:<size>" asks for an answer of <size> bytes; anything else is echoed.
        if request.startswith(b"N:"):
            return b"r" * int(request[2:])
        return request

    async def stream(
        self, request: bytes, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        # b"<count>" streams that many messages; b"hold" one, then waits for the client to go.
        completed = False
        try:
            for index in range(1 if request == b"hold" else int(request)):
                yield b"%d" % index
            if request == b"hold":
                await asyncio.sleep(3600)
            completed = True
        finally:
            if not completed:  # cancelled, or closed by gRPC when the client left
                self.cancelled.set()

    async def fail(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "lease 100% gone: é",
            trailing_metadata=(("pdserve-error", "KVLeaseExpired"), ("x-blob-bin", b"\x00\xff")),
        )
        raise AssertionError("unreachable")

    async def slow(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self.started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return b""


def _handler(service: EchoService) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Echo": grpc.unary_unary_rpc_method_handler(service.echo),
            "Stream": grpc.unary_stream_rpc_method_handler(service.stream),
            "Fail": grpc.unary_unary_rpc_method_handler(service.fail),
            "Slow": grpc.unary_unary_rpc_method_handler(service.slow),
        },
    )


async def _server(
    service: EchoService, port: int = 0, options: list[tuple[str, object]] | None = None
) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server(
        options=[
            ("grpc.max_receive_message_length", 8 << 20),
            ("grpc.max_send_message_length", 8 << 20),
            *(options or []),
        ]
    )
    server.add_generic_rpc_handlers((_handler(service),))
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


def _channel(port: int, **kwargs: object) -> H2GrpcChannel:
    return H2GrpcChannel(f"127.0.0.1:{port}", max_message_bytes=8 << 20, **kwargs)  # type: ignore[arg-type]


async def test_large_messages_cross_frames_and_windows_both_ways() -> None:
    server, port = await _server(EchoService())
    channel = _channel(port)
    try:
        big = os.urandom(3 << 20)  # far over 16 KiB frames and the 64 KiB initial windows
        assert await asyncio.wait_for(channel.unary(ECHO, big, timeout_s=30), CALL_BOUND_S) == big
        answer = await channel.unary(ECHO, b"N:%d" % (5 << 20), timeout_s=30)
        assert answer == b"r" * (5 << 20)
        assert await channel.unary(ECHO, b"", timeout_s=30) == b""  # an empty message
    finally:
        await channel.close()
        await server.stop(None)


async def test_more_calls_than_the_servers_concurrent_streams_all_complete() -> None:
    server, port = await _server(EchoService(), options=[("grpc.max_concurrent_streams", 2)])
    channel = _channel(port)
    try:
        payloads = [os.urandom(100_000) for _ in range(24)]
        answers = await asyncio.wait_for(
            asyncio.gather(*(channel.unary(ECHO, p, timeout_s=30) for p in payloads)),
            CALL_BOUND_S,
        )
        assert answers == payloads
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_status_comes_with_its_details_and_trailing_metadata() -> None:
    server, port = await _server(EchoService())
    channel = _channel(port)
    try:
        with pytest.raises(CallFailed) as failed:
            await asyncio.wait_for(channel.unary(FAIL, b"", timeout_s=30), CALL_BOUND_S)
        assert failed.value.code is grpc.StatusCode.FAILED_PRECONDITION
        assert failed.value.details == "lease 100% gone: é"
        assert ("pdserve-error", "KVLeaseExpired") in failed.value.metadata
        assert ("x-blob-bin", b"\x00\xff") in failed.value.metadata
        with pytest.raises(CallFailed) as missing:
            await channel.unary(b"/test.Echo/Nope", b"", timeout_s=30)
        assert missing.value.code is grpc.StatusCode.UNIMPLEMENTED
        # The connection is still good after failed calls.
        assert await channel.unary(ECHO, b"ok", timeout_s=30) == b"ok"
    finally:
        await channel.close()
        await server.stop(None)


async def test_streams_arrive_in_order_and_leaving_early_cancels_on_the_server() -> None:
    service = EchoService()
    server, port = await _server(service)
    channel = _channel(port)
    try:
        got = [m async for m in channel.server_stream(STREAM, b"2000", timeout_s=30)]
        assert got == [b"%d" % i for i in range(2000)]
        stream = channel.server_stream(STREAM, b"hold", timeout_s=30)
        assert await asyncio.wait_for(anext(stream), CALL_BOUND_S) == b"0"
        await stream.aclose()
        await asyncio.wait_for(service.cancelled.wait(), CALL_BOUND_S)
    finally:
        await channel.close()
        await server.stop(None)


async def test_deadline_and_cancellation_end_the_call_on_the_server() -> None:
    service = EchoService()
    server, port = await _server(service)
    channel = _channel(port)
    try:
        with pytest.raises(CallFailed) as late:
            await asyncio.wait_for(channel.unary(SLOW, b"", timeout_s=0.3), CALL_BOUND_S)
        assert late.value.code is grpc.StatusCode.DEADLINE_EXCEEDED
        await asyncio.wait_for(service.cancelled.wait(), CALL_BOUND_S)
        service.cancelled.clear()
        service.started.clear()
        call = asyncio.create_task(channel.unary(SLOW, b"", timeout_s=30))
        await asyncio.wait_for(service.started.wait(), CALL_BOUND_S)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        await asyncio.wait_for(service.cancelled.wait(), CALL_BOUND_S)
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_message_over_the_bound_fails_resource_exhausted() -> None:
    server, port = await _server(EchoService())
    channel = H2GrpcChannel(f"127.0.0.1:{port}", max_message_bytes=1000)
    try:
        with pytest.raises(CallFailed) as large:
            await asyncio.wait_for(channel.unary(ECHO, b"N:5000", timeout_s=30), CALL_BOUND_S)
        assert large.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert await channel.unary(ECHO, b"N:10", timeout_s=30) == b"r" * 10
    finally:
        await channel.close()
        await server.stop(None)


async def test_refused_then_a_stopped_server_then_a_new_one_on_the_same_port() -> None:
    server, port = await _server(EchoService())
    channel = _channel(port)
    try:
        assert await channel.unary(ECHO, b"1", timeout_s=30) == b"1"
        await server.stop(None)  # GOAWAY, then the connection closes
        with pytest.raises(CallFailed) as refused:
            for _ in range(100):  # until the channel has seen the GOAWAY or the close
                await asyncio.wait_for(channel.unary(ECHO, b"2", timeout_s=5), CALL_BOUND_S)
                await asyncio.sleep(0.05)
        assert refused.value.code is grpc.StatusCode.UNAVAILABLE
        server, _ = await _server(EchoService(), port=port)
        # The channel connects again once its reconnect back-off has passed.
        await asyncio.sleep(RECONNECT_MAX_BACKOFF_S * (1 + RECONNECT_JITTER))
        assert await asyncio.wait_for(channel.unary(ECHO, b"3", timeout_s=30), CALL_BOUND_S) == b"3"
    finally:
        await channel.close()
        await server.stop(None)


async def test_a_failed_connect_backs_off_calls_fail_at_once_meanwhile() -> None:
    """A server that closes every connection at once: the first call's connect fails; the calls
    right after it fail UNAVAILABLE without a new connection (the back-off), naming the error."""
    accepted = 0

    def closing(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal accepted
        accepted += 1
        writer.close()

    server = await asyncio.start_server(closing, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    backoff_s = 3.0  # far longer than a loaded machine's gap between two calls
    channel = _channel(port, reconnect_backoff_s=backoff_s)
    try:
        async with asyncio.timeout(CALL_BOUND_S):
            with pytest.raises(CallFailed) as first:
                await channel.unary(ECHO, b"1", timeout_s=CALL_BOUND_S)
            assert first.value.code is grpc.StatusCode.UNAVAILABLE
            with pytest.raises(CallFailed) as backing_off:
                await channel.unary(ECHO, b"2", timeout_s=CALL_BOUND_S)
            assert backing_off.value.code is grpc.StatusCode.UNAVAILABLE
            assert "(reconnect back-off)" in backing_off.value.details
            assert first.value.details in backing_off.value.details
            assert accepted == 1
            await asyncio.sleep(backoff_s * (1 + RECONNECT_JITTER))
            with pytest.raises(CallFailed) as again:
                await channel.unary(ECHO, b"3", timeout_s=CALL_BOUND_S)
            assert "(reconnect back-off)" not in again.value.details
            assert accepted == 2  # a new attempt once the back-off passed
    finally:
        await channel.close()
        server.close()
        await server.wait_closed()


SERVER_SCRIPT = """
import asyncio, sys, grpc, grpc.aio
async def echo(request, context):
    return request
async def main():
    server = grpc.aio.server(options=[
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 100),
        ("grpc.http2.max_ping_strikes", 0),
    ])
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        "test.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
asyncio.run(main())
"""


@pytest.fixture
def server_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    process = subprocess.Popen(
        [sys.executable, "-c", SERVER_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        assert process.stdout is not None
        yield process, int(process.stdout.readline())
    finally:
        process.send_signal(signal.SIGCONT)
        process.kill()
        process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


async def test_a_frozen_server_is_found_by_the_keepalive_ping(
    server_process: tuple[subprocess.Popen[str], int],
) -> None:
    process, port = server_process
    channel = _channel(port, keepalive_s=0.5, keepalive_timeout_s=1.0)
    try:
        assert await asyncio.wait_for(channel.unary(ECHO, b"x", timeout_s=30), CALL_BOUND_S) == b"x"
        process.send_signal(signal.SIGSTOP)
        # No deadline of its own: only the keepalive can end this call.
        with pytest.raises(CallFailed) as lost:
            await asyncio.wait_for(channel.unary(ECHO, b"y", timeout_s=None), CALL_BOUND_S)
        assert lost.value.code is grpc.StatusCode.UNAVAILABLE
        assert "keepalive" in lost.value.details
        process.send_signal(signal.SIGCONT)
        assert await asyncio.wait_for(channel.unary(ECHO, b"z", timeout_s=30), CALL_BOUND_S) == b"z"
    finally:
        await channel.close()


@pytest.mark.parametrize("loop_factory", [uvloop.new_event_loop, asyncio.new_event_loop])
def test_a_loop_late_past_the_ping_bound_still_reads_the_answer(
    server_process: tuple[subprocess.Popen[str], int],
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
) -> None:
    """The keepalive runs on the router's loop (grpc.aio's ran on gRPC's threads): a loop held
    past a ping's bound while the answer arrived must read it before it judges the connection,
    which lives on with its calls."""
    _, port = server_process

    async def scenario() -> None:
        channel = _channel(port, keepalive_s=0.2, keepalive_timeout_s=0.5)
        try:
            assert await asyncio.wait_for(channel.unary(ECHO, b"a", timeout_s=30), 60) == b"a"
            connection = channel._connection
            assert connection is not None
            sock = connection._transport.get_extra_info("socket")  # type: ignore[union-attr]
            blocked: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
            send_keepalive = connection._send_keepalive

            def send_then_block() -> None:
                # The next ping goes out, then the loop is held (as a long callback would hold
                # it) past the ping's bound and until the answer is in the socket.
                send_keepalive()
                connection._flush()
                bound = time.monotonic() + 0.5 + 0.2
                readable: list[int] = []
                for _ in range(6000):  # 60 s at most
                    readable, _, _ = select.select([sock.fileno()], [], [], 0.01)
                    if readable and time.monotonic() > bound:
                        break
                    time.sleep(0.01)
                connection._send_keepalive = send_keepalive  # type: ignore[method-assign]
                blocked.set_result(bool(readable) and time.monotonic() > bound)

            connection._send_keepalive = send_then_block  # type: ignore[method-assign]
            assert await asyncio.wait_for(blocked, 60)
            await asyncio.sleep(0.3)  # the late timer, the read, the verdict
            assert channel._connection is connection and connection.is_open
            assert await asyncio.wait_for(channel.unary(ECHO, b"b", timeout_s=30), 60) == b"b"
        finally:
            await channel.close()

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        runner.run(scenario())
