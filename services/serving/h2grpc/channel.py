"""A gRPC channel to one target over HTTP/2 frames handled on the event loop itself.

:class:`H2GrpcChannel` makes unary and server-streaming calls with serialized messages in and
out. It opens one connection lazily, shares it between concurrent calls, and opens a new one
when it was lost or the server sent GOAWAY. Every failure is a
:class:`~services.serving.h2grpc.errors.CallFailed` with the status gRPC itself gives it
(UNAVAILABLE for a refused or lost connection, DEADLINE_EXCEEDED for the call's deadline...);
a server that breaks HTTP/2 fails the calls it touched with a message naming the breach, and the
next call opens a new connection (see :mod:`~services.serving.h2grpc.connection`).

A call the server never processed (REFUSED_STREAM before any answer, or above a GOAWAY's last
stream id: RFC 9113 §8.7) is sent once more, on a fresh connection, within its own deadline; each
such retry is counted through ``on_retry`` (``"refused_stream"``, ``"goaway"``). A failed connect
starts a back-off (:data:`RECONNECT_BACKOFF_S`, times :data:`RECONNECT_MULTIPLIER` per failure up
to :data:`RECONNECT_MAX_BACKOFF_S`, each with +-:data:`RECONNECT_JITTER` jitter), during which
calls fail UNAVAILABLE at once with the last connect error, as gRPC's channels do in
TRANSIENT_FAILURE: an engine that is down is not hammered by every request. The router makes one
channel per engine generation, so a restarted engine starts without back-off.

Why not ``grpc.aio``: a grpc.aio call costs the caller about 0.3 ms of CPU here (its Python call
objects, and a hop from gRPC's poller thread to the loop for every event), a streamed message
about 0.07 ms; the router makes two calls a request. This channel does the same work in a few
tens of microseconds (docs/h2grpc.md). It is a client only, for the calls the
router makes on its hot path; engines serve with ``grpc.aio``.
"""

from __future__ import annotations

import asyncio
import logging
import random
import ssl
from collections.abc import AsyncGenerator, Callable, Sequence

import grpc

from services.serving.h2grpc import grpc_wire
from services.serving.h2grpc.call import Call
from services.serving.h2grpc.connection import H2Connection, ProtocolErrorHook
from services.serving.h2grpc.errors import CallFailed, NotStarted, Violation

DEFAULT_KEEPALIVE_S = 10.0
DEFAULT_KEEPALIVE_TIMEOUT_S = 5.0
DEFAULT_SETTINGS_ACK_TIMEOUT_S = 10.0
"""How long a server has to acknowledge the client's SETTINGS (RFC 9113 §6.5.3)."""
DEFAULT_HANDSHAKE_TIMEOUT_S = 20.0
"""How long a new connection may take to be usable (TCP, TLS, the server's SETTINGS), whatever
the call's deadline: grpc-core's minimum connect timeout. A server that accepts TCP and never
speaks HTTP/2 had held a call without a deadline forever."""
START_ATTEMPTS = 3
"""Connections a call may wait on for a stream before it fails UNAVAILABLE: a connection that
goes away (GOAWAY, set aside) while calls wait there hands them to the next one."""
RECONNECT_BACKOFF_S = 0.1
RECONNECT_MULTIPLIER = 1.6
RECONNECT_MAX_BACKOFF_S = 2.0
RECONNECT_JITTER = 0.2

logger = logging.getLogger(__name__)

RetryHook = Callable[[str], None]
"""Called with why a call was sent again (``"refused_stream"``, ``"goaway"``)."""


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` as (host, port); raises ``ValueError`` otherwise."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"gRPC target {target!r} is not host:port")
    return host.strip("[]"), int(port)


class H2GrpcChannel:
    """Calls to the gRPC server at ``target`` (``host:port``); see the module docstring.

    ``ssl_context`` (ALPN ``h2``) makes it TLS, checked against ``server_name`` (default: the
    host). ``on_protocol_error`` counts the server's breaches, ``on_retry`` the calls sent again.
    Safe for concurrent calls from the loop it was first used on; :meth:`close` when done.
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
        settings_ack_timeout_s: float = DEFAULT_SETTINGS_ACK_TIMEOUT_S,
        handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S,
        reconnect_backoff_s: float = RECONNECT_BACKOFF_S,
        on_protocol_error: ProtocolErrorHook | None = None,
        on_retry: RetryHook | None = None,
    ) -> None:
        self.target = target
        self._host, self._port = split_target(target)
        self._ssl = ssl_context
        self._server_name = server_name
        self._authority = (server_name or target).encode()
        self._max_message_bytes = max_message_bytes
        self._keepalive_s = keepalive_s
        self._keepalive_timeout_s = keepalive_timeout_s
        self._settings_ack_timeout_s = settings_ack_timeout_s
        self._handshake_timeout_s = handshake_timeout_s
        self._on_protocol_error = on_protocol_error
        self._on_retry = on_retry
        self._connection: H2Connection | None = None
        self._connecting: asyncio.Future[H2Connection] | None = None
        self._draining: set[H2Connection] = set()
        self._first_backoff_s = reconnect_backoff_s
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self._connect_error = ""

    def buffered_bytes(self) -> int:
        """The bytes this channel holds for its open calls: received and not yet read,
        partial messages, and requests not yet sent (bounded per call by the streams'
        windows, :data:`~services.serving.h2grpc.http2_base.STREAM_WINDOW`)."""
        connections = [c for c in (self._connection, *self._draining) if c is not None]
        return sum(c.held_bytes for c in connections)

    async def unary(
        self,
        path: bytes,
        request: bytes,
        *,
        timeout_s: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> bytes:
        """One unary call of ``path`` (``/package.Service/Method``) with ``metadata`` (see
        :func:`~services.serving.h2grpc.grpc_wire.metadata_block`; ``ValueError`` before anything
        is sent when it breaks gRPC's rules): the answer's bytes."""
        fields = grpc_wire.metadata_block(metadata) if metadata else b""
        deadline = self._deadline(timeout_s)
        call = await self._start(path, request, deadline, fields, streaming=False)
        while True:
            try:
                await call.wait()
            except asyncio.CancelledError:
                call.cancel()
                raise
            if call.code is grpc.StatusCode.OK:
                break
            call = await self._again(call, path, request, deadline, fields)
        if call.unread != 1:
            raise CallFailed(
                grpc.StatusCode.INTERNAL,
                f"a unary answer from {self.target} had {call.unread} messages",
            )
        return call.take()

    async def server_stream(
        self,
        path: bytes,
        request: bytes,
        *,
        timeout_s: float | None,
        metadata: Sequence[tuple[str, str | bytes]] = (),
    ) -> AsyncGenerator[bytes, None]:
        """One server-streaming call with ``metadata`` (as :meth:`unary`'s): its messages as
        they arrive. Leaving the iteration early (``aclose``, or the consuming task cancelled)
        cancels the call."""
        fields = grpc_wire.metadata_block(metadata) if metadata else b""
        deadline = self._deadline(timeout_s)
        call = await self._start(path, request, deadline, fields, streaming=True)
        try:
            while True:
                while call.unread:
                    yield call.take()
                if call.code is not None:
                    if call.code is grpc.StatusCode.OK:
                        return
                    call = await self._again(call, path, request, deadline, fields)
                    continue
                await call.wait()
        finally:
            call.cancel()

    @staticmethod
    def _deadline(timeout_s: float | None) -> float | None:
        return None if timeout_s is None else asyncio.get_running_loop().time() + timeout_s

    async def _again(
        self, failed: Call, path: bytes, request: bytes, deadline: float | None, fields: bytes
    ) -> Call:
        """``failed`` sent again on a fresh connection when the server never processed it and
        it was not sent again already; otherwise raises its failure."""
        if not failed.unprocessed or failed.retried:
            raise failed.failure()
        if self._on_retry is not None:
            self._on_retry(failed.unprocessed)
        if self._connection is failed.connection:
            self._set_aside(failed.connection)
        call = await self._start(path, request, deadline, fields, streaming=failed.streaming)
        call.retried = True
        return call

    def _set_aside(self, connection: H2Connection) -> None:
        """New calls go to a fresh connection; ``connection``'s own calls finish there, then it
        closes."""
        self._connection = None
        if connection.is_open:
            connection.retire()
            self._draining.add(connection)

    async def _start(
        self,
        path: bytes,
        request: bytes,
        deadline: float | None,
        fields: bytes,
        *,
        streaming: bool,
    ) -> Call:
        """A call on the current connection (opened when there is none usable); ``fields``:
        the request's encoded metadata. A call whose connection went away while it waited there
        for a stream (a GOAWAY, or set aside after a refused stream) was never sent: it starts
        on the channel's current connection, up to :data:`START_ATTEMPTS` connections."""
        for attempt in range(1, START_ATTEMPTS + 1):
            connection = self._connection
            if connection is None or not connection.usable:
                loop = asyncio.get_running_loop()
                connection = await self._connect(
                    loop, None if deadline is None else deadline - loop.time()
                )
            try:
                return await connection.start(
                    path, request, deadline=deadline, streaming=streaming, metadata=fields
                )
            except NotStarted:
                if attempt == START_ATTEMPTS:
                    raise
        raise AssertionError("unreachable")

    async def _connect(
        self, loop: asyncio.AbstractEventLoop, timeout_s: float | None
    ) -> H2Connection:
        """The connection new calls go to, opened once for all the callers waiting on it."""
        old = self._connection
        if old is not None and not old.usable:
            self._set_aside(old)  # a GOAWAY: its calls finish there
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
        now = loop.time()
        if now < self._retry_at:
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"{self._connect_error}; the next attempt in {self._retry_at - now:.2f} s "
                f"(reconnect back-off)",
            )
        opening = self._connecting = loop.create_future()
        try:
            connection = await self._open(loop, timeout_s)
        except BaseException as exc:
            if isinstance(exc, CallFailed) and exc.code is grpc.StatusCode.UNAVAILABLE:
                self._back_off(loop, exc.details)
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
        self._backoff_s = self._retry_at = 0.0
        self._connection = connection
        opening.set_result(connection)
        return connection

    def _back_off(self, loop: asyncio.AbstractEventLoop, error: str) -> None:
        """A connect failed with ``error``: no new attempt before the back-off has passed."""
        self._backoff_s = min(
            self._backoff_s * RECONNECT_MULTIPLIER if self._backoff_s else self._first_backoff_s,
            max(RECONNECT_MAX_BACKOFF_S, self._first_backoff_s),
        )
        jitter = random.uniform(1 - RECONNECT_JITTER, 1 + RECONNECT_JITTER)
        self._retry_at = loop.time() + self._backoff_s * jitter
        self._connect_error = error

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
                settings_ack_timeout_s=self._settings_ack_timeout_s,
                on_protocol_error=self._on_protocol_error,
            )

        # Bounded by the handshake bound and by the call's deadline, whichever comes first.
        handshake_at = loop.time() + self._handshake_timeout_s
        deadline_at = None if timeout_s is None else loop.time() + timeout_s
        connected = False
        try:
            async with asyncio.timeout_at(
                handshake_at if deadline_at is None else min(handshake_at, deadline_at)
            ):
                transport, connection = await loop.create_connection(
                    protocol,
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=(self._server_name or self._host) if self._ssl else None,
                )
                connected = True
                try:
                    self._check_alpn(transport)
                    # Its limits first: a server resets the streams over its limit.
                    await connection.settled
                except BaseException:
                    transport.abort()
                    raise
        except TimeoutError:
            if deadline_at is not None and deadline_at <= handshake_at:
                raise CallFailed(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"connecting to {self.target}: Deadline Exceeded",
                ) from None
            bound = f"within {self._handshake_timeout_s:g} s (the handshake bound)"
            if not connected:
                raise CallFailed(
                    grpc.StatusCode.UNAVAILABLE,
                    f"failed to connect to {self.target}: no connection {bound}",
                ) from None
            if self._on_protocol_error is not None:
                try:
                    self._on_protocol_error(Violation.HANDSHAKE_TIMEOUT)
                except Exception:
                    logger.exception("the h2grpc protocol-error hook failed")
            raise CallFailed(
                grpc.StatusCode.UNAVAILABLE,
                f"failed to connect to {self.target}: it accepted the connection but sent no "
                f"HTTP/2 SETTINGS {bound}",
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
