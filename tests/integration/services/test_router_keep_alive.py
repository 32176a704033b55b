"""The router's idle keep-alive connections (uvicorn, stub engines, real HTTP/1.1 on a socket).

A client that pools connections reuses an idle one until its own expiry (the ``openai`` SDK's
httpx: 5 s). A server that closes idle connections at the same age (uvicorn's default, 5 s)
races it: the request sent as the server closes gets no response at all ("Server disconnected
without sending a response", seen in a full run under load). The router keeps idle connections
open for ``http_keep_alive_s`` (75 s), past the clients', so the client retires them first.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import openai
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.stub import StubBackend
from services.router.config import RouterSettings
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

KEEP_ALIVE_S = 0.5
"""A short keep-alive for the test, so that its expiry can be watched."""
CLIENT_EXPIRY_S = 5.0
"""httpx's (so the ``openai`` SDK's) idle expiry, and uvicorn's default keep-alive."""
READ_BOUND_S = 30.0


@contextlib.asynccontextmanager
async def router(
    cp_settings: ControlPlaneSettings, checkpoint: Path, **update: float
) -> AsyncIterator[str]:
    """A router on stub engines (its URL), ``update`` on its settings; ``checkpoint`` is the
    stub model's synthetic one."""
    engine_settings = service_settings(cp_settings)
    settings = RouterSettings(
        control_plane=cp_settings, tokenizer=checkpoint, served_model_name="stub", **update
    )
    async with (
        hosted(engine_settings, StubBackend(), engine_id="prefill-k", role=EngineRole.PREFILL),
        hosted(engine_settings, StubBackend(), engine_id="decode-k", role=EngineRole.DECODE),
        serving_router(settings) as url,
    ):
        yield url


async def connect(url: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(httpx.URL(url).host, httpx.URL(url).port)


async def _get_health(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bytes:
    """One ``GET /health`` on the open connection; its status line."""
    writer.write(b"GET /health HTTP/1.1\r\nHost: router\r\n\r\n")
    await writer.drain()
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_BOUND_S)
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    await asyncio.wait_for(reader.readexactly(length), READ_BOUND_S)
    return head.split(b"\r\n", 1)[0]


async def test_a_connection_idle_past_the_clients_expiry_is_still_served(
    cp_settings: ControlPlaneSettings, stub_checkpoint: Path
) -> None:
    """Idle for longer than httpx's expiry and uvicorn's default keep-alive (5 s each): with
    the router's default, the same connection still answers the next request."""
    async with router(cp_settings, stub_checkpoint) as url:
        reader, writer = await connect(url)
        try:
            assert await _get_health(reader, writer) == b"HTTP/1.1 200 OK"
            await asyncio.sleep(CLIENT_EXPIRY_S + 0.5)
            assert await _get_health(reader, writer) == b"HTTP/1.1 200 OK"
        finally:
            writer.close()


async def test_an_idle_connection_is_closed_after_the_keep_alive_set(
    cp_settings: ControlPlaneSettings, stub_checkpoint: Path
) -> None:
    async with router(cp_settings, stub_checkpoint, http_keep_alive_s=KEEP_ALIVE_S) as url:
        reader, writer = await connect(url)
        try:
            assert await _get_health(reader, writer) == b"HTTP/1.1 200 OK"
            await asyncio.sleep(KEEP_ALIVE_S / 5)
            assert await _get_health(reader, writer) == b"HTTP/1.1 200 OK"  # the same one
            # Idle past the setting: the router closes it (end of stream, nothing else sent).
            await asyncio.sleep(KEEP_ALIVE_S * 3)
            assert await asyncio.wait_for(reader.read(), READ_BOUND_S) == b""
        finally:
            writer.close()


def test_the_default_keep_alive_outlives_the_clients_idle_expiry() -> None:
    """The ``openai`` SDK's and httpx's pooled connections expire after 5 s idle; the router
    must not close them first (aiohttp's 15 s and a load balancer's 60 s are outlived too)."""
    openai_expiry = openai.DEFAULT_CONNECTION_LIMITS.keepalive_expiry
    httpx_expiry = httpx.Limits().keepalive_expiry
    assert openai_expiry is not None and httpx_expiry is not None
    default = RouterSettings().http_keep_alive_s
    assert default > max(openai_expiry, httpx_expiry, 15.0, 60.0)
