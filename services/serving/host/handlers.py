"""Registering a pdserve servicer on a grpc.aio server so that undecodable requests are
INVALID_ARGUMENT.

The generated ``add_*Servicer_to_server`` functions deserialize requests with
``Message.FromString``. When the bytes do not parse, that raises inside grpc.aio, before any
pdserve code runs, and grpc.aio answers with a bare ``UNKNOWN`` ("Unexpected <class
'DecodeError'>...") and logs a traceback per call: a hostile client could fill the logs, and
the caller cannot tell a bad request from a broken engine.

:func:`add_servicer` registers the same methods instead, read from the service's descriptor
in the generated ``*_pb2`` module (names, message types, streaming kind), with a request
deserializer that returns :class:`~services.serving.wire.fields.Undecodable` rather than raising.
The method behaviour answers an ``Undecodable`` through :meth:`ServingState.rpc` (so it is
INVALID_ARGUMENT with ``pdserve-error: InvalidRequest`` from the status table, counted in
``pdserve_engine_requests_total{outcome="INVALID_ARGUMENT"}``, and answered even while the
engine is not admitting) and never calls the servicer, which therefore only sees parsed
messages. Everything else is passed through unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from google.protobuf.descriptor import MethodDescriptor, ServiceDescriptor
from google.protobuf.message import DecodeError, Message
from google.protobuf.message_factory import GetMessageClass

from services.serving.host.servicer import AnyContext, ServingState
from services.serving.wire.fields import Undecodable

RequestDeserializer = Callable[[bytes], "Message | Undecodable"]
UnaryBehaviour = Callable[[Any, AnyContext], Awaitable[Message]]
StreamBehaviour = Callable[[Any, AnyContext], AsyncGenerator[Message, None]]


def add_servicer(
    server: grpc.aio.Server,
    service: ServiceDescriptor,
    servicer: object,
    state: ServingState,
) -> None:
    """Register every method of ``service`` (e.g. ``prefill_pb2.DESCRIPTOR.services_by_name
    ["PrefillService"]``) on ``server``, served by the same-named methods of ``servicer``.

    Raises :class:`ValueError` for a client-streaming method (pdserve has none) and
    :class:`AttributeError` when ``servicer`` lacks a method: both are programming errors
    found at start-up, not per call.
    """
    handlers = {method.name: _method_handler(method, servicer, state) for method in service.methods}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    # As the generated code does: lets the server match calls from generated stubs (which
    # mark their methods registered) without the generic lookup. Missing from grpc-stubs.
    server.add_registered_method_handlers(service.full_name, handlers)  # type: ignore[attr-defined]


def _method_handler(
    method: MethodDescriptor, servicer: object, state: ServingState
) -> grpc.RpcMethodHandler[Any, Any]:
    if method.client_streaming:
        raise ValueError(f"{method.full_name}: client-streaming RPCs are not supported")
    behaviour = getattr(servicer, method.name)
    deserializer = _tolerant_deserializer(method)
    serializer = GetMessageClass(method.output_type).SerializeToString
    if method.server_streaming:
        return grpc.unary_stream_rpc_method_handler(
            _stream_behaviour(method.name, behaviour, state),
            request_deserializer=deserializer,
            response_serializer=serializer,
        )
    return grpc.unary_unary_rpc_method_handler(
        _unary_behaviour(method.name, behaviour, state),
        request_deserializer=deserializer,
        response_serializer=serializer,
    )


def _tolerant_deserializer(method: MethodDescriptor) -> RequestDeserializer:
    """``FromString`` of the method's request message, but :class:`Undecodable` on bad bytes."""
    message_class = GetMessageClass(method.input_type)
    message_type = method.input_type.full_name

    def deserialize(data: bytes) -> Message | Undecodable:
        try:
            return message_class.FromString(data)
        except DecodeError as exc:
            return Undecodable(method.name, message_type, len(data), str(exc))

    return deserialize


async def _refuse(rpc: str, request: Undecodable, state: ServingState, context: AnyContext) -> None:
    """Answer INVALID_ARGUMENT through the shared RPC wrapper (counted like any bad request);
    ``rpc()`` aborts the call, so this never returns normally."""
    async with state.rpc(rpc, context, admit=False):
        raise request.error()


def _unary_behaviour(
    rpc: str, behaviour: UnaryBehaviour, state: ServingState
) -> Callable[[Any, AnyContext], Awaitable[Message]]:
    async def handle(request: Message | Undecodable, context: AnyContext) -> Message:
        if isinstance(request, Undecodable):
            await _refuse(rpc, request, state, context)
            raise AssertionError("unreachable: rpc() aborts the call on error")
        return await behaviour(request, context)

    return handle


def _stream_behaviour(
    rpc: str, behaviour: StreamBehaviour, state: ServingState
) -> Callable[[Any, AnyContext], AsyncIterator[Message]]:
    # An async generator function, as grpc.aio requires to treat it as a response stream.
    async def handle(request: Message | Undecodable, context: AnyContext) -> AsyncIterator[Message]:
        if isinstance(request, Undecodable):
            await _refuse(rpc, request, state, context)
            return
        # aclosing: when grpc.aio closes this generator (the caller went away), the servicer's
        # own generator is closed at once too, so its clean-up (abort, release) runs now.
        async with contextlib.aclosing(behaviour(request, context)) as responses:
            async for response in responses:
                yield response

    return handle
