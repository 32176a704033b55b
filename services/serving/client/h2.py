"""The router's calls to one engine over :class:`~services.serving.h2grpc.H2GrpcChannel`:
:class:`H2EngineClient`, the same calls, messages and errors as
:class:`~services.serving.client.grpc_aio.GrpcAioEngineClient` (Prefill, Decode, DecodeOnce, Abort)
at a fraction of grpc.aio's CPU per call (docs/h2grpc.md).

Errors are those of ``GrpcAioEngineClient``: the engine's :mod:`services.engines.errors` class
rebuilt from the status and its trailing metadata, and
:class:`~services.serving.errors.EngineUnreachable` for the transport's failures, through the one
table of :mod:`services.serving.wire.status`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from google.protobuf.message import DecodeError

from services.engines.lora import LoRAAdapter
from services.engines.requests import (
    DecodeRequest,
    PrefillRequest,
    PrefillResult,
    SamplingParams,
    TokenDelta,
)
from services.engines.trace_context import TraceContext
from services.proto_gen.pdserve.v1 import decode_pb2, engine_pb2, prefill_pb2
from services.serving.client.connector import EngineConnector
from services.serving.errors import ProtocolMismatch
from services.serving.h2grpc import CallFailed, H2GrpcChannel
from services.serving.tls import ClientTLS
from services.serving.wire import convert
from services.serving.wire.convert import DEFAULT_MAX_MESSAGE_BYTES
from services.serving.wire.status import error_from_status
from services.serving.wire.trace_metadata import to_metadata

_PREFILL = b"/pdserve.v1.PrefillService/Prefill"
_DECODE = b"/pdserve.v1.DecodeService/Decode"
_DECODE_ONCE = b"/pdserve.v1.DecodeService/DecodeOnce"
_ABORT = b"/pdserve.v1.EngineService/Abort"
_LOAD_LORA = b"/pdserve.v1.EngineService/LoadLoRA"
_UNLOAD_LORA = b"/pdserve.v1.EngineService/UnloadLoRA"


class H2EngineClient(EngineConnector):
    """A client of one engine service at ``target`` (``host:port``), over TLS with ``tls``.

    The connection is opened on the first call within the running event loop; safe for
    concurrent calls from that loop. ``close`` when done. ``on_protocol_error`` is called with a
    label (:class:`~services.serving.h2grpc.errors.Violation`) each time the engine breaks
    HTTP/2 or gRPC's framing; ``on_retry`` with the reason each time a call the engine never
    processed is sent again (:class:`~services.serving.h2grpc.H2GrpcChannel`).
    """

    def __init__(
        self,
        target: str,
        *,
        tls: ClientTLS | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        on_protocol_error: Callable[[str], None] | None = None,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        self.target = target
        self._channel = H2GrpcChannel(
            target,
            max_message_bytes=max_message_bytes,
            ssl_context=tls.ssl_context if tls is not None else None,
            server_name=tls.server_name if tls is not None else None,
            on_protocol_error=on_protocol_error,
            on_retry=on_retry,
        )
        # A failed call's status as the engine's error class (services.serving.wire.status).
        self._errors = {
            rpc: _StatusAsError(target, rpc)
            for rpc in ("Prefill", "Decode", "DecodeOnce", "Abort", "LoadLoRA", "UnloadLoRA")
        }

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
        message = convert.prefill_request_to_proto(
            PrefillRequest(request_id, tuple(prompt_token_ids), sampling, lora=lora)
        )
        with self._errors["Prefill"]:
            data = await self._channel.unary(
                _PREFILL,
                message.SerializeToString(),
                timeout_s=timeout_s,
                metadata=to_metadata(trace),
            )
        return convert.prefill_result_from_proto(
            _parsed(prefill_pb2.PrefillResponse(), data, "Prefill", self.target)
        )

    async def decode(
        self, request: DecodeRequest, *, timeout_s: float | None = None
    ) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens. Errors before the first delta raise; closing the
        iterator early cancels the call and the engine aborts the request. ``request.trace``
        goes as the call's metadata (so in :meth:`decode_once`)."""
        payload = convert.decode_request_to_proto(request).SerializeToString()
        stream = self._channel.server_stream(
            _DECODE, payload, timeout_s=timeout_s, metadata=to_metadata(request.trace)
        )
        try:
            with self._errors["Decode"]:
                async for data in stream:
                    chunk = _parsed(decode_pb2.DecodeChunk(), data, "Decode", self.target)
                    yield convert.delta_from_proto(chunk)
        finally:
            await stream.aclose()

    async def decode_once(
        self, request: DecodeRequest, *, idle_timeout_s: float, timeout_s: float | None = None
    ) -> TokenDelta:
        """The request's whole result in one delta (``DecodeOnce``), as
        :meth:`GrpcAioEngineClient.decode_once
        <services.serving.client.grpc_aio.GrpcAioEngineClient.decode_once>`."""
        message = convert.decode_request_to_proto(request, idle_timeout_s=idle_timeout_s)
        with self._errors["DecodeOnce"]:
            data = await self._channel.unary(
                _DECODE_ONCE,
                message.SerializeToString(),
                timeout_s=timeout_s,
                metadata=to_metadata(request.trace),
            )
        return convert.delta_from_proto(
            _parsed(decode_pb2.DecodeChunk(), data, "DecodeOnce", self.target)
        )

    async def abort(
        self, request_id: str, *, timeout_s: float | None = 5.0, trace: TraceContext | None = None
    ) -> bool:
        """Abort a running request or release held KV; ``False`` when the engine does not
        know the id. ``trace``: the request's, as the call's metadata."""
        payload = engine_pb2.AbortRequest(request_id=request_id).SerializeToString()
        with self._errors["Abort"]:
            data = await self._channel.unary(
                _ABORT, payload, timeout_s=timeout_s, metadata=to_metadata(trace)
            )
        return _parsed(engine_pb2.AbortResponse(), data, "Abort", self.target).found

    async def load_lora(
        self, adapter: LoRAAdapter, *, load_inplace: bool = False, timeout_s: float | None = None
    ) -> tuple[str, ...]:
        payload = engine_pb2.LoadLoRARequest(
            adapter=convert.lora_to_proto(adapter), load_inplace=load_inplace
        ).SerializeToString()
        with self._errors["LoadLoRA"]:
            data = await self._channel.unary(_LOAD_LORA, payload, timeout_s=timeout_s)
        return tuple(_parsed(engine_pb2.LoRAAdapters(), data, "LoadLoRA", self.target).names)

    async def unload_lora(self, name: str, *, timeout_s: float | None = None) -> bool:
        payload = engine_pb2.UnloadLoRARequest(name=name).SerializeToString()
        with self._errors["UnloadLoRA"]:
            data = await self._channel.unary(_UNLOAD_LORA, payload, timeout_s=timeout_s)
        return _parsed(engine_pb2.UnloadLoRAResponse(), data, "UnloadLoRA", self.target).found

    async def close(self) -> None:
        """Close the connection (in-flight calls fail); the next call opens a new one."""
        await self._channel.close()


class _StatusAsError:
    """A ``with`` block whose :class:`CallFailed` leaves as the engine's error class, named by
    the client's target and the RPC. Holds no state of a call: one per RPC, reused (a
    ``contextlib`` generator cost two objects and a generator per call)."""

    __slots__ = ("_rpc", "_target")

    def __init__(self, target: str, rpc: str) -> None:
        self._target = target
        self._rpc = rpc

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: object, exc: BaseException | None, traceback: object) -> None:
        if isinstance(exc, CallFailed):
            raise error_from_status(
                exc.code, exc.details, exc.metadata, target=self._target, rpc=self._rpc
            ) from None


_Message = TypeVar(
    "_Message",
    prefill_pb2.PrefillResponse,
    decode_pb2.DecodeChunk,
    engine_pb2.AbortResponse,
    engine_pb2.LoRAAdapters,
    engine_pb2.UnloadLoRAResponse,
)


def _parsed(message: _Message, data: bytes, rpc: str, target: str) -> _Message:
    try:
        message.ParseFromString(data)
    except DecodeError as exc:
        raise ProtocolMismatch(f"{rpc} on engine {target}: unreadable answer: {exc}") from None
    return message
