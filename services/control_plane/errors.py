"""Errors of the control plane.

::

    ControlPlaneError
    ├── ControlPlaneUnavailable      Redis unreachable after the configured retries (process-level:
    │                                callers back off or fail their readiness)
    ├── EngineNotFound               no live registration for that engine id (never registered, or
    │                                its lease expired)
    ├── StaleGenerationError         the caller's generation is no longer the engine's current one
    │                                (a restart or re-registration fenced it off)
    ├── EngineNotReady               the engine's PP x TP grid is not complete and consistent
    ├── HandshakeRejected            a handshake record refused at publication
    │   ├── PipelineParallelUnsupported   pp_rank > 0 from an engine that is not PP-aware
    │   └── DuplicateRankError            a second worker claims a (pp_rank, tp_rank) already held
    └── RecordDecodeError            a value read from Redis is malformed, oversized, of another
                                     protocol version or contradicts its key (Redis is a trust
                                     boundary: readers reject, count and report, never crash)

Every error carries a short machine-readable ``reason`` used as a metric label.
"""

from __future__ import annotations


class ControlPlaneError(Exception):
    """Base of every control-plane error."""

    reason: str = "error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class ControlPlaneUnavailable(ControlPlaneError):
    """Redis could not be reached after the configured retries with backoff."""

    reason = "unavailable"


class EngineNotFound(ControlPlaneError):
    """No live registration exists for the engine (never registered or lease expired)."""

    reason = "engine_not_found"


class StaleGenerationError(ControlPlaneError):
    """The caller acted for a generation that is no longer the engine's current one."""

    reason = "stale_generation"


class EngineNotReady(ControlPlaneError):
    """The engine's handshake grid is incomplete or inconsistent; ``problems`` says why."""

    reason = "not_ready"

    def __init__(self, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class HandshakeRejected(ControlPlaneError):
    """A handshake record was refused before it reached Redis."""

    reason = "rejected"


class PipelineParallelUnsupported(HandshakeRejected):
    """An engine that declared itself not PP-aware published a record with ``pp_rank > 0``."""

    reason = "not_pp_aware"


class DuplicateRankError(HandshakeRejected):
    """Another worker already holds this ``(pp_rank, tp_rank)`` in the current generation."""

    reason = "duplicate_rank"


class RecordDecodeError(ControlPlaneError):
    """A stored value is not a valid record: ``reason`` names how (oversized, malformed...)."""

    reason = "malformed"
