"""The one table between engine errors and gRPC status codes, used by both ends.

Servers answer a :class:`~services.engines.errors.RequestError` with its status code, its
message as details and trailing metadata ``pdserve-error: <class name>`` (plus
``pdserve-reason`` for :class:`KVTransferFailed`). Clients rebuild the same class from the
metadata, so UNAVAILABLE from an engine (``ProducerUnavailable``, ``EngineDraining``...) is
never confused with UNAVAILABLE from the transport (no metadata: :class:`EngineUnreachable`).
"""

from __future__ import annotations

from collections.abc import Sequence

import grpc

from services.engines.errors import (
    DuplicateRequest,
    EngineDraining,
    EngineFailed,
    EngineOverloaded,
    EngineStalled,
    InvalidRequest,
    KVLeaseExpired,
    KVTransferFailed,
    LoRAAdapterNotFound,
    LoRANotServed,
    ProducerUnavailable,
    RequestAborted,
    UnknownKVHandle,
)
from services.serving.errors import EngineUnreachable, ProtocolMismatch

ERROR_KEY = "pdserve-error"
REASON_KEY = "pdserve-reason"

Metadata = tuple[tuple[str, str], ...]

_CODE_OF: dict[type[Exception], grpc.StatusCode] = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    LoRANotServed: grpc.StatusCode.INVALID_ARGUMENT,
    LoRAAdapterNotFound: grpc.StatusCode.NOT_FOUND,
    DuplicateRequest: grpc.StatusCode.ALREADY_EXISTS,
    UnknownKVHandle: grpc.StatusCode.NOT_FOUND,
    KVLeaseExpired: grpc.StatusCode.FAILED_PRECONDITION,
    ProducerUnavailable: grpc.StatusCode.UNAVAILABLE,
    KVTransferFailed: grpc.StatusCode.UNAVAILABLE,
    EngineDraining: grpc.StatusCode.UNAVAILABLE,
    EngineOverloaded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestAborted: grpc.StatusCode.CANCELLED,
    EngineStalled: grpc.StatusCode.DEADLINE_EXCEEDED,
    EngineFailed: grpc.StatusCode.INTERNAL,
}
_CLASS_BY_NAME: dict[str, type[Exception]] = {cls.__name__: cls for cls in _CODE_OF}

# What a status code means when it carries no pdserve metadata (an older server, or a proxy).
_DEFAULT_CLASS: dict[grpc.StatusCode, type[Exception]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.ALREADY_EXISTS: DuplicateRequest,
    grpc.StatusCode.NOT_FOUND: UnknownKVHandle,
    grpc.StatusCode.FAILED_PRECONDITION: KVLeaseExpired,
    grpc.StatusCode.CANCELLED: RequestAborted,
    grpc.StatusCode.INTERNAL: EngineFailed,
    grpc.StatusCode.UNKNOWN: EngineFailed,
    grpc.StatusCode.DATA_LOSS: EngineFailed,
}
# Without metadata these come from the transport, not from the engine.
_TRANSPORT_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)


def status_for(exc: Exception) -> tuple[grpc.StatusCode, str, Metadata]:
    """The status code, details and trailing metadata that report ``exc`` to a client.

    Anything not in the table (a bug) is INTERNAL, so a client never sees a bare UNKNOWN.
    """
    for cls in type(exc).__mro__:
        code = _CODE_OF.get(cls)
        if code is not None:
            metadata: Metadata = ((ERROR_KEY, cls.__name__),)
            if isinstance(exc, KVTransferFailed):
                metadata += ((REASON_KEY, exc.reason),)
            return code, str(exc) or cls.__name__, metadata
    return (
        grpc.StatusCode.INTERNAL,
        f"internal error: {type(exc).__name__}: {exc}",
        ((ERROR_KEY, EngineFailed.__name__),),
    )


def error_from_status(
    code: grpc.StatusCode,
    details: str,
    metadata: Sequence[tuple[str, str | bytes]],
    *,
    target: str,
    rpc: str,
) -> Exception:
    """The exception a client raises for a failed call to ``target`` (inverse of status_for)."""
    found = {key: value for key, value in metadata if isinstance(value, str)}
    message = f"{rpc} on engine {target}: {details or code.name}"
    cls = _CLASS_BY_NAME.get(found.get(ERROR_KEY, ""))
    if cls is not None and _CODE_OF[cls] is code:
        if cls is KVTransferFailed:
            return KVTransferFailed(message, found.get(REASON_KEY, "unknown"))
        return cls(message)
    if code in _TRANSPORT_CODES:
        return EngineUnreachable(message, target)
    if code is grpc.StatusCode.UNIMPLEMENTED:
        return ProtocolMismatch(f"{message} (wrong role for this RPC?)")
    if code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        # Without metadata it is gRPC's own limit (message too large), not a full engine.
        return InvalidRequest(message)
    return _DEFAULT_CLASS.get(code, EngineFailed)(message)
