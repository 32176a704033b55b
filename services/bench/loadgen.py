"""A lean HTTP/1.1 load generator and an instant HTTP server, for ``pdserve bench router``.

Why not httpx: measured alone against an instant server, one httpx event loop tops out near
800 requests/s on this kind of machine, below what a Rust router serves, so it measured itself.
This generator writes one pre-encoded request per keep-alive connection and reads the answer
with the smallest parse that is still correct (status line, ``content-length`` or chunked body),
and the bench runs several of its processes. Its own ceiling is measured in the same run
against :func:`serve_instant` (a raw asyncio server answering a fixed body), and its CPU per
request is read from ``/proc``, so the report says how far it was from being the bottleneck.

Run as a process (the bench does)::

    python -m services.bench.loadgen run URL BODY_JSON CONNECTIONS START_AT STOP_AT
    python -m services.bench.loadgen serve PORT

``run`` opens CONNECTIONS keep-alive connections, sends until ``STOP_AT`` (unix seconds),
records latencies of requests that started at or after ``START_AT`` (earlier ones warm up),
and prints one JSON line: ``completed``, ``errors``, ``first_error``, ``latencies_us``.
It imports nothing from pdserve: it must start fast and cost little.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any
from urllib.parse import urlsplit

_MAX_HEADER_BYTES = 64 * 1024


class HTTPError(Exception):
    """A response that is not ``200`` or not a well-formed HTTP/1.1 answer."""


def encode_request(url: str, body: bytes) -> tuple[str, int, bytes]:
    """``(host, port, request bytes)`` of a keep-alive JSON POST to ``url``."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.hostname is None:
        raise ValueError(f"only http:// URLs are supported: {url!r}")
    port = parts.port or 80
    head = (
        f"POST {parts.path or '/'} HTTP/1.1\r\n"
        f"host: {parts.hostname}:{port}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: keep-alive\r\n\r\n"
    )
    return parts.hostname, port, head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """One response's status and body (``content-length`` or ``chunked``)."""
    head = await reader.readuntil(b"\r\n\r\n")
    if len(head) > _MAX_HEADER_BYTES:
        raise HTTPError("response headers too long")
    lines = head.decode("latin-1").split("\r\n")
    status_line = lines[0].split(" ", 2)
    if len(status_line) < 2 or not status_line[0].startswith("HTTP/1."):
        raise HTTPError(f"not an HTTP/1.1 status line: {lines[0]!r}")
    status = int(status_line[1])
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value.lower():
            chunked = True
    if chunked:
        body = bytearray()
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0], 16)
            if size == 0:
                await reader.readuntil(b"\r\n")  # no trailers expected: the final CRLF
                return status, bytes(body)
            body += await reader.readexactly(size + 2)
            del body[-2:]
    if length is None:
        raise HTTPError("response without content-length or chunked encoding")
    return status, await reader.readexactly(length)


async def _connection(
    host: str,
    port: int,
    request: bytes,
    start_at: float,
    stop_at: float,
    latencies: list[int],
    errors: list[str],
) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        while (now := time.time()) < stop_at:
            started = time.perf_counter()
            writer.write(request)
            try:
                status, body = await read_response(reader)
            except (HTTPError, asyncio.IncompleteReadError, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
                return
            if status != 200:
                errors.append(f"HTTP {status}: {body[:200]!r}")
                continue
            if now >= start_at:
                latencies.append(int((time.perf_counter() - started) * 1e6))
    finally:
        writer.close()


async def run(
    url: str, body: bytes, connections: int, start_at: float, stop_at: float
) -> dict[str, Any]:
    """Closed loop of ``connections`` keep-alive connections (see the module docstring)."""
    host, port, request = encode_request(url, body)
    latencies: list[int] = []
    errors: list[str] = []
    results = await asyncio.gather(
        *(
            _connection(host, port, request, start_at, stop_at, latencies, errors)
            for _ in range(connections)
        ),
        return_exceptions=True,
    )
    errors += [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return {
        "completed": len(latencies),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "latencies_us": latencies,
    }


# -- the instant server ---------------------------------------------------------------------------

INSTANT_BODY = b'{"id":"instant","object":"text_completion","choices":[]}'


class _Instant(asyncio.Protocol):
    """Answers every request on the connection with :data:`INSTANT_BODY` (requests are
    assumed to carry ``content-length``, as :func:`encode_request` sends them)."""

    response = (
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
        + str(len(INSTANT_BODY)).encode()
        + b"\r\n\r\n"
        + INSTANT_BODY
    )

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        while True:
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            length = 0
            for line in bytes(self._buffer[:end]).split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            total = end + 4 + length
            if len(self._buffer) < total:
                return
            del self._buffer[:total]
            assert self._transport is not None
            self._transport.write(self.response)


async def serve_instant(port: int) -> None:
    """Serve :class:`_Instant` on ``127.0.0.1:port`` until cancelled."""
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Instant, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> int:
    if len(argv) == 6 and argv[0] == "run":
        url, body, connections, start_at, stop_at = argv[1:]
        result = asyncio.run(
            run(url, body.encode(), int(connections), float(start_at), float(stop_at))
        )
        sys.stdout.write(json.dumps(result) + "\n")
        return 0
    if len(argv) == 2 and argv[0] == "serve":
        asyncio.run(serve_instant(int(argv[1])))
        return 0
    sys.stderr.write(__doc__ or "")
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
