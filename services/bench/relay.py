"""``pdserve bench relay``: what a decode host's gRPC server spends per streamed token, one
message per token and stream (what the Decode RPC does) against one message per engine step
carrying every stream's token (a stream multiplexed per router connection).

A grpc.aio server in its own process serves ``pdserve.v1.DecodeService/Decode`` paced by one
shared step ticker (an engine step every ``--step-ms``): each call streams ``--tokens`` steps,
one ``DecodeChunk`` a step, converted as the decode host converts a delta
(:func:`~services.serving.wire.convert.delta_to_proto`); a call of width ``w`` stands for ``w``
streams multiplexed: one chunk a step with ``w`` tokens. The client (grpc.aio, this process)
runs each case's calls at once and reads the server process's CPU clock around them. The
ticker's own wake-ups are measured alone first (``ticker_cpu_ms_per_step``): they are in every
case, as an engine's output wakes a host whatever the transport.

Nothing of vLLM or of the engine host runs here: the figure is the transport's part of the
relay (docs/benchmarks.md, 2026-11-28, the relay's CPU).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import multiprocessing.queues
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio

from services.bench.procs import cpu_seconds, load_average
from services.engines.requests import TokenDelta
from services.proto_gen.pdserve.v1 import decode_pb2, decode_pb2_grpc
from services.serving.wire import convert

START_TIMEOUT_S = 60.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--step-ms", type=float, default=8.0, help="engine step (ms)")
    parser.add_argument("--tokens", type=int, default=64, help="steps a call streams")
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each case's calls")
    parser.add_argument(
        "--streams",
        default="1,4,8",
        help="streams decoding at once: each measured as that many calls (one message per "
        "token and stream) and as one call of that width (one message per step)",
    )


class _Ticker:
    """One engine step every ``step_s``, shared by every call (as one engine's steps are)."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.step = 0
        self._changed = asyncio.Condition()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            async with self._changed:
                self.step += 1
                self._changed.notify_all()

    async def after(self, step: int) -> int:
        async with self._changed:
            await self._changed.wait_for(lambda: self.step > step)
            return self.step


class _PacedDecode(decode_pb2_grpc.DecodeServiceServicer):
    def __init__(self, ticker: _Ticker) -> None:
        self.ticker = ticker

    async def Decode(  # noqa: N802 (gRPC method name)
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[decode_pb2.DecodeRequest, decode_pb2.DecodeChunk],
    ) -> AsyncIterator[decode_pb2.DecodeChunk]:
        tokens, width = (int(part) for part in request.request_id.split("-")[1:3])
        step = self.ticker.step
        for index in range(tokens):
            step = await self.ticker.after(step)
            ids = tuple(1000 + index + stream for stream in range(width))
            yield convert.delta_to_proto(TokenDelta(ids, " tok" * width))

    async def DecodeOnce(  # noqa: N802 (gRPC method name)
        self,
        request: decode_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext[decode_pb2.DecodeRequest, decode_pb2.DecodeChunk],
    ) -> decode_pb2.DecodeChunk:
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "the relay bench streams (Decode)")
        raise AssertionError("unreachable: abort raises")


def _serve(step_s: float, ports: multiprocessing.queues.Queue[int]) -> None:
    async def main() -> None:
        ticker = _Ticker(step_s)
        server = grpc.aio.server()
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(_PacedDecode(ticker), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        ticker_task = asyncio.get_running_loop().create_task(ticker.run())
        ports.put(port)
        try:
            await server.wait_for_termination()
        finally:
            ticker_task.cancel()

    asyncio.run(main())


async def _case(
    stub: decode_pb2_grpc.DecodeServiceAsyncStub, pid: int, calls: int, width: int, args: Any
) -> dict[str, Any]:
    async def one(tokens: int) -> int:
        received = 0
        request = decode_pb2.DecodeRequest(request_id=f"relay-{tokens}-{width}")
        async for chunk in stub.Decode(request):
            received += len(chunk.token_ids)
        return received

    await one(2)  # warm: the channel's streams and the server's handler
    before = cpu_seconds([pid])
    received = 0
    for _ in range(args.rounds):
        received += sum(await asyncio.gather(*(one(args.tokens) for _ in range(calls))))
    used = cpu_seconds([pid]) - before
    expected = args.rounds * calls * width * args.tokens
    if received != expected:
        raise RuntimeError(f"received {received} tokens, expected {expected}")
    return {
        "streams": calls * width,
        "messages_per_step": calls,
        "tokens": received,
        "server_cpu_ms_per_token": round(1000 * used / received, 4),
    }


async def _measure(port: int, pid: int, args: Any) -> dict[str, Any]:
    streams = [int(part) for part in args.streams.split(",") if part]
    step_s = args.step_ms / 1000
    before = cpu_seconds([pid])
    idle_steps = max(1, int(1.0 / step_s))
    await asyncio.sleep(idle_steps * step_s)
    ticker_ms = 1000 * (cpu_seconds([pid]) - before) / idle_steps
    cases = []
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        for count in streams:
            cases.append(await _case(stub, pid, count, 1, args))
            if count > 1:
                cases.append(await _case(stub, pid, 1, count, args))
    return {"ticker_cpu_ms_per_step": round(ticker_ms, 4), "cases": cases}


def run(args: argparse.Namespace) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")
    ports: multiprocessing.queues.Queue[int] = context.Queue()
    server = context.Process(target=_serve, args=(args.step_ms / 1000, ports), daemon=True)
    started = time.monotonic()
    server.start()
    try:
        port = ports.get(timeout=START_TIMEOUT_S)
        assert server.pid is not None
        load_before = [round(value, 2) for value in load_average()]
        figures = asyncio.run(_measure(port, server.pid, args))
    finally:
        server.terminate()
        server.join(timeout=10)
        if server.is_alive():
            server.kill()
            server.join()
    return {
        "step_ms": args.step_ms,
        "tokens_per_call": args.tokens,
        "rounds": args.rounds,
        "load_average": {
            "before": load_before,
            "after": [round(value, 2) for value in load_average()],
        },
        "wall_s": round(time.monotonic() - started, 1),
        **figures,
    }
