"""The router's seam to engines: one :class:`EngineConnector` per engine generation.

The router calls engines only through this seam, and only engines it found READY in the control
plane: a connector is built from an :class:`~services.control_plane.wire.EngineRecord`, never
from anything in a request. :class:`GrpcConnectorFactory` wraps the services' gRPC client
(``services.serving.h2_client.H2EngineClient`` by default, or grpc.aio's
``services.serving.client.EngineClient``); unit tests use a fake.
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import AsyncIterator, Callable, Sequence

from services.control_plane.wire import EngineRecord
from services.engines.backend import DecodeRequest, PrefillResult, SamplingParams, TokenDelta
from services.engines.errors import EngineStalled
from services.engines.trace_context import TraceContext
from services.router.config import GrpcClientName
from services.serving.client import DEFAULT_MAX_MESSAGE_BYTES, EngineClient
from services.serving.convert import merge_deltas
from services.serving.h2_client import H2EngineClient
from services.serving.tls import ClientTLS


class EngineConnector(abc.ABC):
    """Calls on one engine. Safe to share between concurrent requests.

    Errors: the classes of :mod:`services.engines.errors` (``InvalidRequest``,
    ``EngineOverloaded``, ``EngineDraining``, ``UnknownKVHandle``, ``KVLeaseExpired``,
    ``ProducerUnavailable``, ``KVTransferFailed``, ``EngineFailed``...) as the engine raised
    them, and ``services.serving.errors.EngineUnreachable`` when the engine cannot be reached
    or the call outlives ``timeout_s`` (the transport's deadline). The router times its calls
    itself, with ``timeout_s`` as a backstop a little later, so that its own
    ``TimeoutError`` names the bound that tripped; it translates all of them (see
    :func:`services.router.errors.engine_error`).

    Every call of a request carries the request's W3C trace context when it has one (``trace``,
    or ``DecodeRequest.trace``): the gRPC connector sends it as the call's metadata.
    """

    @abc.abstractmethod
    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        timeout_s: float | None = None,
        trace: TraceContext | None = None,
    ) -> PrefillResult:
        """Prefill on this engine; the KV is held for a consumer until the handle's lease."""

    @abc.abstractmethod
    def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        """Stream the request's tokens; closing the iterator early aborts the request."""

    async def decode_once(
        self, request: DecodeRequest, *, idle_timeout_s: float, timeout_s: float | None = None
    ) -> TokenDelta:
        """The request's whole result as one delta (for a caller that does not stream it on).
        When no step comes within ``idle_timeout_s`` (the first included) the engine's request
        is aborted and :class:`~services.engines.errors.EngineStalled` raised; ``timeout_s``
        bounds the whole call. Cancelling the awaiting task aborts the request. A stream that
        ends without a finish is returned without one (the caller decides).

        This default reads :meth:`decode` to its end under the idle bound; the gRPC connector
        makes one ``DecodeOnce`` call instead (the engine enforces the bound)."""
        stream = self.decode(request, timeout_s=timeout_s)
        steps: list[TokenDelta] = []
        try:
            while True:
                try:
                    async with asyncio.timeout(idle_timeout_s) as bound:
                        step = await anext(stream)
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if not bound.expired():
                        raise
                    raise EngineStalled(
                        f"no step of {request.request_id} within "
                        f"idle_timeout_s={idle_timeout_s:g} s"
                    ) from None
                steps.append(step)
                if step.finish_reason is not None:
                    break
        finally:
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
        return merge_deltas(steps) if steps else TokenDelta((), "")

    @abc.abstractmethod
    async def abort(self, request_id: str, *, trace: TraceContext | None = None) -> bool:
        """Abort a request or release its held KV; ``False`` when the engine does not know it."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Release the connection. Idempotent."""


class ConnectorFactory(abc.ABC):
    """Builds the connector of a READY engine generation (called by the engine pool)."""

    @abc.abstractmethod
    def connect(self, record: EngineRecord) -> EngineConnector:
        """A connector to ``record.endpoint``; cheap (connections are made lazily)."""


class GrpcConnector(EngineConnector):
    """:class:`EngineConnector` over a gRPC engine client: both clients have the same calls,
    messages and errors."""

    def __init__(self, client: H2EngineClient | EngineClient) -> None:
        self._client = client

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        timeout_s: float | None = None,
        trace: TraceContext | None = None,
    ) -> PrefillResult:
        return await self._client.prefill(
            request_id, prompt_token_ids, sampling, timeout_s=timeout_s, trace=trace
        )

    def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        return self._client.decode(request, timeout_s=timeout_s)

    async def decode_once(
        self, request: DecodeRequest, *, idle_timeout_s: float, timeout_s: float | None = None
    ) -> TokenDelta:
        return await self._client.decode_once(
            request, idle_timeout_s=idle_timeout_s, timeout_s=timeout_s
        )

    async def abort(self, request_id: str, *, trace: TraceContext | None = None) -> bool:
        return await self._client.abort(request_id, trace=trace)

    async def close(self) -> None:
        await self._client.close()


class GrpcConnectorFactory(ConnectorFactory):
    """Connectors over gRPC to the engine services (``pdserve prefill`` / ``decode``) with
    ``client`` (:data:`~services.router.config.GrpcClientName`), over TLS when ``tls`` is given
    (its files are read here, so a missing one fails at start-up). ``on_protocol_error`` counts
    an engine's breaches of HTTP/2 and ``on_retry`` the calls sent again because the engine never
    processed them (the h2 client only: grpc.aio counts neither)."""

    def __init__(
        self,
        tls: ClientTLS | None = None,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        client: GrpcClientName = "h2",
        on_protocol_error: Callable[[str], None] | None = None,
        on_retry: Callable[[str], None] | None = None,
    ) -> None:
        if tls is not None:  # its files read now: a missing one fails at start-up
            if client == "h2":
                tls.ssl_context  # noqa: B018 - built once, shared by every engine's client
            else:
                tls.credentials()
        self._tls = tls
        self._max_message_bytes = max_message_bytes
        self._h2 = client == "h2"
        self._on_protocol_error = on_protocol_error
        self._on_retry = on_retry

    def connect(self, record: EngineRecord) -> EngineConnector:
        if self._h2:
            return GrpcConnector(
                H2EngineClient(
                    record.endpoint,
                    tls=self._tls,
                    max_message_bytes=self._max_message_bytes,
                    on_protocol_error=self._on_protocol_error,
                    on_retry=self._on_retry,
                )
            )
        return GrpcConnector(
            EngineClient(record.endpoint, tls=self._tls, max_message_bytes=self._max_message_bytes)
        )
