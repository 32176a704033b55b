"""Backpressure from a slow HTTP client through the router to the engine's stream.

A real router (uvicorn, the h2grpc engine client) over real stub engine hosts (gRPC), in one
event loop. A client asks for a stream of a million tokens (the most the router takes) and stops
reading after the first bytes. The router's response write blocks (the socket's buffers fill),
it stops reading the engine's stream, the stream's HTTP/2 window (h2grpc's STREAM_WINDOW) is not
given back, and the engine's writes block: the tokens the engine generated stop growing far
short of the request. Without that chain the engine generates every token (the router buffers
them). Closing the client's connection then aborts the request on the engine.
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.registry import synthetic_model
from services.engines.requests import DecodeRequest, TokenDelta
from services.engines.stub import StubBackend
from services.engines.stub.backend import StubOptions
from services.router.config import RouterSettings
from services.serving.h2grpc.http2_base import STREAM_WINDOW
from services.tokenization.synthetic_checkpoint import write_synthetic_checkpoint
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

MAX_TOKENS = 1_000_000
MAX_MODEL_LEN = 4 * MAX_TOKENS
"""The engines' context and the router's (its checkpoint's), room for the request."""
BOUND_S = 180.0
"""Outer bound of the whole test; reaching it fails it."""
STILL_S = 3.0
"""How long the engine's count must not move to call the stream held."""
HELD_TOKENS_BOUND = 400_000
"""At most this many tokens are in flight when the stream is held: the stream's window and the
unread half window at about 10 bytes a token on the gRPC side (3 * STREAM_WINDOW / 10), the
sockets' buffers (a few MiB on loopback) at about 100 bytes a token as SSE events;
two fifths of what was asked."""


class CountingStub(StubBackend):
    """A stub engine that counts the tokens its decode streams generated."""

    def __init__(self) -> None:
        super().__init__(StubOptions(max_model_len=MAX_MODEL_LEN, num_kv_blocks=1 << 20))
        self.generated = 0

    async def decode(self, request: DecodeRequest) -> AsyncIterator[TokenDelta]:
        async for delta in super().decode(request):
            self.generated += len(delta.token_ids)
            yield delta


async def test_a_client_that_stops_reading_stops_the_engine(
    cp_settings: ControlPlaneSettings, tmp_path: Path
) -> None:
    assert 3 * STREAM_WINDOW // 10 < HELD_TOKENS_BOUND
    engine_settings = service_settings(cp_settings)
    stub = synthetic_model("stub")
    checkpoint = write_synthetic_checkpoint(
        tmp_path / stub.name, vocab_size=stub.vocab_size, max_model_len=MAX_MODEL_LEN
    )
    router = RouterSettings(
        control_plane=cp_settings,
        tokenizer=checkpoint,
        served_model_name=stub.name,
        decode_timeout_s=BOUND_S,
    )
    decode = CountingStub()
    loop = asyncio.get_running_loop()
    async with (
        hosted(engine_settings, StubBackend(), engine_id="prefill-bp", role=EngineRole.PREFILL),
        hosted(engine_settings, decode, engine_id="decode-bp", role=EngineRole.DECODE),
        serving_router(router) as url,
        asyncio.timeout(BOUND_S),
    ):
        host, port = url.removeprefix("http://").split(":")
        client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 10)
        client.setblocking(False)
        try:
            await loop.sock_connect(client, (host, int(port)))
            body = json.dumps(
                {"model": "stub", "prompt": [1, 2, 3], "max_tokens": MAX_TOKENS, "stream": True}
            ).encode()
            request = (
                b"POST /v1/completions HTTP/1.1\r\nhost: router\r\n"
                b"content-type: application/json\r\ncontent-length: %d\r\n\r\n" % len(body)
            ) + body
            await loop.sock_sendall(client, request)
            first = await loop.sock_recv(client, 4096)
            assert first.startswith(b"HTTP/1.1 200"), first[:200]
            # Not read any more: the engine's count must come to rest.
            last, still_since = -1, loop.time()
            while loop.time() - still_since < STILL_S:
                await asyncio.sleep(0.25)
                if decode.generated != last:
                    last, still_since = decode.generated, loop.time()
            assert 0 < decode.generated <= HELD_TOKENS_BOUND, decode.generated
            assert decode._running  # the stream is held open, not finished
        finally:
            client.close()
        # The client left: the router cancels the call and the engine aborts the request.
        await decode._idle.wait()
        assert decode.generated < MAX_TOKENS
