"""How the router gets its seam to engines: one
:class:`~services.serving.client.connector.EngineConnector` per engine generation.

The router calls engines only through that seam, and only engines it found READY in the control
plane: a connector is built from an :class:`~services.control_plane.wire.EngineRecord`, never
from anything in a request. :class:`GrpcConnectorFactory` builds the services' gRPC clients
(:class:`~services.serving.client.h2.H2EngineClient` by default, or grpc.aio's
:class:`~services.serving.client.grpc_aio.GrpcAioEngineClient`), each an ``EngineConnector``;
unit tests use a fake.
"""

from __future__ import annotations

import abc
from collections.abc import Callable

from services.control_plane.wire import EngineRecord
from services.router.config import GrpcClientName
from services.serving.client.connector import EngineConnector
from services.serving.client.grpc_aio import GrpcAioEngineClient
from services.serving.client.h2 import H2EngineClient
from services.serving.tls import ClientTLS
from services.serving.wire.convert import DEFAULT_MAX_MESSAGE_BYTES


class ConnectorFactory(abc.ABC):
    """Builds the connector of a READY engine generation (called by the engine pool)."""

    @abc.abstractmethod
    def connect(self, record: EngineRecord) -> EngineConnector:
        """A connector to ``record.endpoint``; cheap (connections are made lazily)."""


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
            return H2EngineClient(
                record.endpoint,
                tls=self._tls,
                max_message_bytes=self._max_message_bytes,
                on_protocol_error=self._on_protocol_error,
                on_retry=self._on_retry,
            )
        return GrpcAioEngineClient(
            record.endpoint, tls=self._tls, max_message_bytes=self._max_message_bytes
        )
