"""The one error of :mod:`services.serving.h2grpc`::

    CallFailed          a call ended with a non-OK gRPC status (from the server, or the
                        transport's outcome mapped as gRPC does: UNAVAILABLE for a refused or
                        lost connection, DEADLINE_EXCEEDED for the call's own deadline,
                        CANCELLED, RESOURCE_EXHAUSTED for a message over the bound...)

Callers translate it with :func:`services.serving.status.error_from_status`, as they do
``grpc.aio.AioRpcError``: the same code, details and trailing metadata.
"""

from __future__ import annotations

import grpc

Metadata = tuple[tuple[str, str | bytes], ...]


class CallFailed(Exception):
    """A call's non-OK status: ``code``, ``details`` and the trailing ``metadata``."""

    def __init__(self, code: grpc.StatusCode, details: str, metadata: Metadata = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.metadata = metadata
