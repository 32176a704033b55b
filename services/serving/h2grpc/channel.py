"""A gRPC channel to one target over HTTP/2 frames handled on the event loop itself.

:class:`H2GrpcChannel` makes unary and server-streaming calls with serialized messages in and
out. It opens one connection lazily, shares it between concurrent calls, and opens a new one
when it was lost or the server sent GOAWAY. Every failure is a
:class:`~services.serving.h2grpc.errors.CallFailed` with the status gRPC itself gives it
(UNAVAILABLE for a refused or lost connection, DEADLINE_EXCEEDED for the call's deadline...);
a server that breaks HTTP/2 fails the calls it touched with a message naming the breach, and the
next call opens a new connection (see :mod:`~services.serving.h2grpc.connection`).

Why not ``grpc.aio``: a grpc.aio call costs the caller about 0.3 ms of CPU here (its Python call
objects, and a hop from gRPC's poller thread to the loop for every event), a streamed message
about 0.07 ms; the router makes two calls a request. This channel does the same work in a few
tens of microseconds (docs/architecture.md, "Hot path"). It is a client only, for the calls the
router makes on its hot path; engines serve with ``grpc.aio``.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncGenerator, Sequence

import grpc

from services.serving.h2grpc.call import Call
from services.serving.h2grpc.connection import H2Connection, ProtocolErrorHook
from services.serving.h2grpc.errors import CallFailed

DEFAULT_KEEPALIVE_S = 10.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 5.0


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); raises ``ValueError`` otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"gRPC target {target!r} is not host:port")
    return host.strip("[]"), int(port)


class H2GrpcChannel:
    """Calls to the gRPC server at ``target`` (``host:port``); see the module docstring.

    ``ssl_context`` (ALPN ``h2``) makes it TLS, checked against ``server_name`` (default: the
    host). Safe for concurrent calls from the loop it was first used on; :meth:`close` when done.
    """

    def __init__(
        self,
        target: str,
        *,
        max_message_bytes: int,
        ssl_context: ssl.SSLContext | None = None,
        server_name: str | None = None,
        keepalive_s: float = DEFAULT_KEEPALIVE_S,
        keepalive_timeout_s: float = DEFAULT_KEEPALIVE_TIMEOUT_S,
        on_protocol_error: ProtocolErrorHook | None = None,
    ) -> None:
        self.target = target
        self._host, self._port = split_target(target)
        self._ssl = ssl_context
        self._server_name = server_name
        self._authority = (server_name or target).encode()
        self._max_message_bytes = max_message_bytes
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._on_protocol_error = on_protocol_error
        self._connection: H2Connection | None = None
        self._connecting: asyncio.Future[H2Connection] | None = None
        self._draining: set[H2Connection] = set()

    async def unary(
        self,
        path: bytes,
        request: bytes,
        *,
        timeout_s: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> bytes:
        """One unary call of ``path`` (``/package.Service/Method``) with ``metadata`` (see
        :func:`~services.serving.h2grpc.frames.metadata_block`): the answer's bytes."""
        call = await self._start(path, request, timeout_s, streaming=False, metadata=metadata)
        try:
            await call.wait()
        except asyncio.CancelledError:
            call.cancel()
            raise
        if call.code is not grpc.StatusCode.OK:
            raise call.failure()
        if len(call.messages) != 1:
            raise CallFailed(
                grpc.StatusCode.INTERNAL,
                f"a unary answer from {self.target} had {len(call.messages)} messages",
            )
        return call.messages[0]

    async def server_stream(
        self,
        path: bytes,
        request: bytes,
        *,
        timeout_s: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> AsyncGenerator[bytes, None]:
        """One server-streaming call with ``metadata``: its messages as they arrive. Leaving
        the iteration early (``aclose``, or the consuming task cancelled) cancels the call."""
        call = await self._start(path, request, timeout_s, streaming=True, metadata=metadata)
        try:
            while True:
                while call.messages:
                    yield call.messages.popleft()
                if call.code is not None:
                    if call.code is not grpc.StatusCode.OK:
                        raise call.failure()
                    return
                await call.wait()
        finally:
            call.cancel()

    async def _start(
        self,
        path: bytes,
        request: bytes,
        timeout_s: float | None,
        *,
        streaming: bool,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> Call:
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        connection = self._connection
        if connection is None or not connection.usable:
            connection = await self._connect(loop, timeout_s)
        return await connection.start(
            path, request, deadline=deadline, streaming=streaming, metadata=metadata
        )

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, timeout_s: float | None
    ) -> H2Connection:
        """The connection new calls go to, opened once for all the callers waiting on it."""
        old = self._connection
        if old is not None and not old.usable:
            self._connection = None
            if old.is_open:
                self._draining.add(old)  # a GOAWAY: its calls finish there
        self._draining = {c for c in self._draining if c.is_open}
        if self._connecting is not None:
            try:
                async with asyncio.timeout(timeout_s):
                    return await asyncio.shield(self._connecting)
            except TimeoutError:
                raise CallFailed(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"connecting to {self.target}: Deadline Exceeded",
                ) from None
        opening = self._connecting = loop.create_future()
        try:
            connection = await self._open(loop, timeout_s)
        except BaseException as exc:
            opening.set_exception(
                exc
                if isinstance(exc, CallFailed)
                else CallFailed(
                    grpc.StatusCode.UNAVAILABLE, f"connecting to {self.target} was abandoned"
                )
            )
            opening.exception()  # retrieved: there may be no other caller waiting on it
            raise
        finally:
            self._connecting = None
        self._connection = connection
        opening.set_result(connection)
        return connection

    async def _open(self, loop: asyncio.AbstractEventLoop, timeout_s: float | None) -> H2Connection:
        def protocol() -> H2Connection:
            return H2Connection(
                loop,
                self.target,
                authority=self._authority,
                tls=self._ssl is not None,
                max_message_bytes=self._max_message_bytes,
                keepalive_s=self._keepalive_s,
                keepalive_timeout_s=self._keepalive_timeout_s,
                on_protocol_error=self._on_protocol_error,
            )

        try:
            async with asyncio.timeout(timeout_s):
                transport, connection = await loop.create_connection(
                    protocol,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=(self._server_name or self._host) if self._ssl else None,
                )
                try:
                    self._check_alpn(transport)
                    # Its limits first: a server resets the streams over its limit.
                    await connection.settled
                except BaseException:
                    transport.abort()
                    raise
        except TimeoutError:
            raise CallFailed(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"connecting to {self.target}: Deadline Exceeded"
            ) from None
        except (OSError, ssl.SSLError) as exc:
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE, f"failed to connect to {self.target}: {exc}"
            ) from None
        return connection

    def _check_alpn(self, transport: asyncio.BaseTransport) -> None:
        if self._ssl is None:
            return
        ssl_object = transport.get_extra_info("ssl_object")
        protocol_name = ssl_object.selected_alpn_protocol() if ssl_object else None
        if protocol_name != "h2":
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"{self.target} did not negotiate HTTP/2 over TLS (ALPN {protocol_name!r})",
            )

    async def close(self) -> None:
        """Close the connections; their open calls fail UNAVAILABLE. Idempotent."""
        connections = [c for c in (self._connection, *self._draining) if c is not None]
        self._connection, self._draining = None, set()
        for connection in connections:
            connection.close(f"channel to {self.target} closed")
        await asyncio.sleep(0)


def client_ssl_context(
    ca_pem: bytes | None, cert_file: str | None, key_file: str | None
) -> ssl.SSLContext:
    """A client TLS context for gRPC: the CA (PEM; system roots when ``None``), an optional
    client certificate and key (files), and ALPN ``h2``."""
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    if ca_pem is not None:
        context.load_verify_locations(cadata=ca_pem.decode())
    if cert_file is not None and key_file is not None:
        context.load_cert_chain(cert_file, key_file)
    context.set_alpn_protocols(["h2"])
    return context
