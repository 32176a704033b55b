"""The router's way to call engines: :class:`GrpcAioEngineClient` (one engine) and
:class:`GrpcAioClientPool` (one channel per target, reused).

Every call raises the engine's error as the same :mod:`services.engines.errors` class the backend
raised (``InvalidRequest``, ``UnknownKVHandle``, ``ProducerUnavailable``, ``EngineOverloaded``,
``EngineDraining``, ``RequestAborted`` for CANCELLED, ``EngineFailed``...), and
:class:`~services.serving.errors.EngineUnreachable` when the engine cannot be reached
(connection refused, deadline exceeded, channel broken). Messages name the target.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.control_plane.wire import EngineLoad
from services.engines.lora import LoRAAdapter
from services.engines.requests import (
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    SamplingParams,
    TokenDelta,
)
from services.engines.trace_context import TraceContext
from services.proto_gen.pdserve.v1 import (
    decode_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    prefill_pb2_grpc,
)
from services.serving.client.connector import EngineConnector
from services.serving.errors import EngineUnreachable
from services.serving.tls import ClientTLS
from services.serving.wire import convert
from services.serving.wire.convert import DEFAULT_MAX_MESSAGE_BYTES
from services.serving.wire.status import error_from_status
from services.serving.wire.trace_metadata import to_metadata


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Find a dead engine within seconds on an idle channel, not at the next request.
        ("grpc.keepalive_time_ms", 10_000),
        ("grpc.keepalive_timeout_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def server_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """Engine servers' options: the clients' keepalive pings (every 10 s, idle or not) are
    accepted, so an idle router channel is not closed with GOAWAY ``too_many_pings``."""
    return [
        *channel_options(max_message_bytes),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.http2.max_ping_strikes", 0),
    ]


@dataclass(frozen=True)
class _Stubs:
    """One channel and the service stubs over it (built together, dropped together)."""

    channel: grpc.aio.Channel
    prefill: prefill_pb2_grpc.PrefillServiceAsyncStub
    decode: decode_pb2_grpc.DecodeServiceAsyncStub
    engine: engine_pb2_grpc.EngineServiceAsyncStub
    health: health_pb2_grpc.HealthStub

    @classmethod
    def over(cls, channel: grpc.aio.Channel) -> _Stubs:
        return cls(
            channel=channel,
            prefill=prefill_pb2_grpc.PrefillServiceStub(channel),
            decode=decode_pb2_grpc.DecodeServiceStub(channel),
            engine=engine_pb2_grpc.EngineServiceStub(channel),
            health=health_pb2_grpc.HealthStub(channel),
        )


class GrpcAioEngineClient(EngineConnector):
    """A client of one engine service (prefill or decode) at ``target`` (``host:port``).

    One HTTP/2 channel, created lazily on first use within the running event loop; safe for
    concurrent calls from that loop. ``close`` when done (or let the pool do it).
    """

    def __init__(
        self,
        target: str,
        *,
        tls: ClientTLS | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ) -> None:
        self.target = target
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._stubs: _Stubs | None = None

    def _connect(self) -> _Stubs:
        if self._stubs is None:
            options = channel_options(self._max_message_bytes)
            if self._tls is None:
                channel = grpc.aio.insecure_channel(self.target, options=options)
            else:
                if self._tls.server_name:
                    options.append(("grpc.ssl_target_name_override", self._tls.server_name))
                channel = grpc.aio.secure_channel(
                    self.target, self._tls.credentials(), options=options
                )
            self._stubs = _Stubs.over(channel)
        return self._stubs

    def _error(self, exc: grpc.aio.AioRpcError, rpc: str) -> Exception:
        # grpc.aio.Metadata iterates as (key, value) pairs (grpc-stubs describes the sync type).
        raw: Any = exc.trailing_metadata() or ()
        metadata = tuple((str(key), value) for key, value in raw)
        return error_from_status(
            exc.code(), exc.details() or "", metadata, target=self.target, rpc=rpc
        )

    @contextlib.contextmanager
    def _translated(self, rpc: str) -> Iterator[None]:
        """Raise a failed call's status as the engine's error class (see the module docstring)."""
        try:
            yield
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc, rpc) from None

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        timeout_s: float | None = None,
        trace: TraceContext | None = None,
        lora: LoRAAdapter | None = None,
    ) -> PrefillResult:
        """Prefill on this engine; the result's ``kv_handle`` goes to a decode engine as is.
        ``trace`` (the request's W3C trace context) goes as the call's metadata."""
        stubs = self._connect()
        message = convert.prefill_request_to_proto(
            PrefillRequest(request_id, tuple(prompt_token_ids), sampling, lora=lora)
        )
        with self._translated("Prefill"):
            response = await stubs.prefill.Prefill(
                message, timeout=timeout_s, metadata=to_metadata(trace)
            )
        return convert.prefill_result_from_proto(response)

    async def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens. Errors before the first delta raise; closing the
        iterator early (``aclose``, ``break`` in ``async for`` then garbage collection, or the
        consuming task being cancelled) cancels the call and the engine aborts the request.
        ``request.trace`` goes as the call's metadata (so in :meth:`decode_once`)."""
        stubs = self._connect()
        message = convert.decode_request_to_proto(request)
        call = stubs.decode.Decode(message, timeout=timeout_s, metadata=to_metadata(request.trace))
        try:
            with self._translated("Decode"):
                async for chunk in call:
                    yield convert.delta_from_proto(chunk)
        finally:
            if not call.done():
                call.cancel()

    async def decode_once(
        self, request: DecodeRequest, *, idle_timeout_s: float, timeout_s: float | None = None
    ) -> TokenDelta:
        """The request's whole result in one delta (``DecodeOnce``): the engine aborts the
        request and this raises :class:`~services.engines.errors.EngineStalled` when no step
        comes within ``idle_timeout_s``; ``timeout_s`` bounds the whole call. Cancelling the
        awaiting task cancels the call and the engine aborts the request. A result without a
        finish reason is returned as it is (the caller decides)."""
        stubs = self._connect()
        message = convert.decode_request_to_proto(request, idle_timeout_s=idle_timeout_s)
        with self._translated("DecodeOnce"):
            chunk = await stubs.decode.DecodeOnce(
                message, timeout=timeout_s, metadata=to_metadata(request.trace)
            )
        return convert.delta_from_proto(chunk)

    async def abort(
        self, request_id: str, *, timeout_s: float | None = 5.0, trace: TraceContext | None = None
    ) -> bool:
        """Abort a running request or release held KV; ``False`` when the engine does not
        know the id. ``trace``: the request's, as the call's metadata."""
        stubs = self._connect()
        with self._translated("Abort"):
            response = await stubs.engine.Abort(
                engine_pb2.AbortRequest(request_id=request_id),
                timeout=timeout_s,
                metadata=to_metadata(trace),
            )
        return response.found

    async def load_lora(
        self, adapter: LoRAAdapter, *, load_inplace: bool = False, timeout_s: float | None = None
    ) -> tuple[str, ...]:
        stubs = self._connect()
        with self._translated("LoadLoRA"):
            response = await stubs.engine.LoadLoRA(
                engine_pb2.LoadLoRARequest(
                    adapter=convert.lora_to_proto(adapter), load_inplace=load_inplace
                ),
                timeout=timeout_s,
            )
        return tuple(response.names)

    async def unload_lora(self, name: str, *, timeout_s: float | None = None) -> bool:
        stubs = self._connect()
        with self._translated("UnloadLoRA"):
            response = await stubs.engine.UnloadLoRA(
                engine_pb2.UnloadLoRARequest(name=name), timeout=timeout_s
            )
        return response.found

    async def get_load(self, *, timeout_s: float | None = 5.0) -> EngineLoad:
        stubs = self._connect()
        with self._translated("GetLoad"):
            response = await stubs.engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=timeout_s)
        return convert.load_from_proto(response)

    async def health(self, *, timeout_s: float | None = 5.0) -> bool:
        """Whether the engine's ``grpc.health.v1`` status is SERVING (READY and not draining).

        Raises :class:`EngineUnreachable` when the engine cannot be reached.
        """
        stubs = self._connect()
        try:
            response = await stubs.health.Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout_s
            )
        except grpc.aio.AioRpcError as exc:
            error = self._error(exc, "Health.Check")
            if isinstance(error, EngineUnreachable):
                raise error from None
            return False
        return bool(response.status == health_pb2.HealthCheckResponse.SERVING)

    async def close(self) -> None:
        """Close the channel (in-flight calls are cancelled); the next call opens a new one.
        Idempotent."""
        stubs, self._stubs = self._stubs, None
        if stubs is not None:
            await stubs.channel.close(grace=None)


class GrpcAioClientPool:
    """One :class:`GrpcAioEngineClient` (one channel) per target, created on first use and
    reused."""

    def __init__(
        self, *, tls: ClientTLS | None = None, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    ) -> None:
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._clients: dict[str, GrpcAioEngineClient] = {}

    def get(self, target: str) -> GrpcAioEngineClient:
        client = self._clients.get(target)
        if client is None:
            client = GrpcAioEngineClient(
                target, tls=self._tls, max_message_bytes=self._max_message_bytes
            )
            self._clients[target] = client
        return client

    def __contains__(self, target: object) -> bool:
        return target in self._clients

    def __len__(self) -> int:
        return len(self._clients)

    async def discard(self, target: str) -> None:
        """Close and forget the client of ``target`` (the engine went away)."""
        client = self._clients.pop(target, None)
        if client is not None:
            await client.close()

    async def close(self) -> None:
        clients, self._clients = list(self._clients.values()), {}
        await asyncio.gather(*(client.close() for client in clients))
