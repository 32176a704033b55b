"""Errors of the KV data plane.

::

    KVTransferError                  base; every error carries a ``reason`` (a metric label)
    ├── BlockPoolError               misuse of a worker's block pool
    │   ├── PoolExhaustedError       fewer free blocks than asked for (back-pressure, not a bug)
    │   └── BlockStateError          double free, incref of a free block, id out of range
    ├── PullSpecError                a pull that cannot be issued as described: a caller bug
    │                                (block ids of unequal length or out of range, a plan that does
    │                                not match this worker's shard or the peer's geometry)
    ├── PeerError                    a remote worker cannot be used
    │   ├── UnknownPeerError         no add_peer for that (engine, pp_rank, tp_rank)
    │   ├── IncompatiblePeerError    its handshake does not fit the local pool (dtype, head size,
    │   │                            block size, layout)
    │   └── StaleGenerationError     the producer restarted (new generation): pulls against the old
    │                                one fail instead of reading a dead agent
    ├── TransferError                NIXL refused or failed one transfer (request-scoped)
    │   ├── RemoteDisconnectedError  the remote agent went away (its process died)
    │   └── TransferTimeoutError     not complete before the pull's deadline
    ├── CompletionError              per-rank completion bookkeeping refused a report
    │   ├── DuplicateReportError     a rank reported a request it already reported
    │   ├── UnknownRankError         a report from a rank outside the engine's PP x TP grid
    │   └── LeaseError               a producer lease misused (held twice, unknown request)
    ├── NotificationDecodeError      a completion notification that does not decode (a remote
    │                                agent is a trust boundary: counted and dropped)
    └── TransportFatalError          the local NIXL agent is unusable (no backend, registration
                                     refused): process-fatal, the worker must not serve

Request-scoped errors (:class:`TransferError`, :class:`PeerError`) mostly travel as data in a
:class:`~services.kv_transfer.transport.PullResult` (``reason`` names them); they are raised only
by the calls that set peers up. :class:`TransportFatalError` is raised and never reported as data.

Third-party errors are translated in exactly one place, :func:`map_nixl_errors`, with one table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class KVTransferError(Exception):
    """Base of every KV data-plane error."""

    reason: str = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class BlockPoolError(KVTransferError):
    """The block pool refused an operation."""

    reason = "block_pool"


class PoolExhaustedError(BlockPoolError):
    """Fewer free blocks than requested; nothing was allocated."""

    reason = "pool_exhausted"


class BlockStateError(BlockPoolError):
    """A block id that is out of range, or in the wrong state (double free, incref of a free)."""

    reason = "block_state"


class PullSpecError(KVTransferError):
    """A pull described inconsistently by its caller; nothing was issued."""

    reason = "invalid_pull"


class PeerError(KVTransferError):
    """A remote worker cannot be used."""

    reason = "peer"


class UnknownPeerError(PeerError):
    """No remote worker was added for that ``(engine, pp_rank, tp_rank)``."""

    reason = "unknown_peer"


class IncompatiblePeerError(PeerError):
    """The remote worker's handshake does not fit the local pool."""

    reason = "incompatible_peer"


class StaleGenerationError(PeerError):
    """The producer engine's generation changed: its old agent must not be read."""

    reason = "stale_generation"


class TransferError(KVTransferError):
    """NIXL refused or failed a transfer."""

    reason = "transfer_error"


class RemoteDisconnectedError(TransferError):
    """The remote agent disconnected (typically: its process died)."""

    reason = "remote_disconnected"


class TransferTimeoutError(TransferError):
    """The transfer did not complete before its deadline; it was aborted."""

    reason = "timeout"


class CompletionError(KVTransferError):
    """Completion bookkeeping refused a report."""

    reason = "completion"


class DuplicateReportError(CompletionError):
    """A rank reported the same request twice (vLLM's contract: exactly once per worker)."""

    reason = "duplicate_report"


class UnknownRankError(CompletionError):
    """A report from a rank outside the engine's PP x TP grid."""

    reason = "unknown_rank"


class LeaseError(CompletionError):
    """A producer lease used wrongly (held twice, released when not held)."""

    reason = "lease"


class NotificationDecodeError(KVTransferError):
    """A notification from a remote agent is malformed, oversized or of another version."""

    reason = "bad_notification"


class TransportFatalError(KVTransferError):
    """The local NIXL agent cannot work; the worker must fail its readiness."""

    reason = "transport_fatal"


# NIXL's pybind exception class name -> (mapped class, reason). Names rather than classes so this
# module does not import nixl (a heavy, optional dependency).
_NIXL_TABLE: dict[str, tuple[type[KVTransferError], str]] = {
    "nixlRemoteDisconnectError": (RemoteDisconnectedError, "remote_disconnected"),
    "nixlBackendError": (TransferError, "backend_error"),
    "nixlCancelledError": (TransferError, "cancelled"),
    "nixlInvalidParamError": (TransferError, "invalid_param"),
    "nixlMismatchError": (TransferError, "mismatch"),
    "nixlNotAllowedError": (TransferError, "not_allowed"),
    "nixlNotFoundError": (TransferError, "not_found"),
    "nixlNotPostedError": (TransferError, "not_posted"),
    "nixlNotSupportedError": (TransferError, "not_supported"),
    "nixlRepostActiveError": (TransferError, "repost_active"),
    "nixlUnknownError": (TransferError, "unknown"),
    "nixlNoTelemetryError": (TransferError, "no_telemetry"),
}


def _is_nixl_error(exc: BaseException) -> bool:
    module = type(exc).__module__ or ""
    return module.startswith("nixl") and type(exc).__name__ in _NIXL_TABLE


@contextlib.contextmanager
def map_nixl_errors(operation: str, *, fatal: bool = False) -> Iterator[None]:
    """Translate NIXL exceptions raised inside the block into this package's errors.

    ``operation`` names what was attempted (it goes into the message). With ``fatal`` (agent
    creation, memory registration) every NIXL failure, and the ``RuntimeError`` NIXL raises when
    no plugin loads, becomes :class:`TransportFatalError`. Errors of this package pass through.
    """
    try:
        yield
    except KVTransferError:
        raise
    except Exception as exc:
        if _is_nixl_error(exc):
            mapped, reason = _NIXL_TABLE[type(exc).__name__]
            if fatal:
                mapped = TransportFatalError
            raise mapped(f"{operation}: {type(exc).__name__}: {exc}", reason=reason) from exc
        if fatal and isinstance(exc, RuntimeError):
            raise TransportFatalError(f"{operation}: {exc}") from exc
        raise
