"""Errors of the serving layer (the gRPC edge between router and engines).

::

    ServingError                    every error raised by services.serving itself
    ├── EngineUnreachable           connection refused, deadline exceeded, channel broken
    │                               (the engine's target is in the message and ``.target``)
    ├── ProtocolMismatch            the engine does not serve that RPC (wrong role) or answered
    │                               something this client cannot read
    └── HostError                   process-fatal errors of ``pdserve prefill|decode``
        ├── ReadinessFailed         the engine turned INVALID or never READY within the bound
        └── RegistrationLost        the control plane fenced this engine off (another process
                                    took its id, or the registration vanished before READY): it
                                    must stop serving (a registration lost while serving is
                                    re-registered instead, see services.serving.host.engine_host)

Request-scoped errors an engine reports travel as gRPC status codes and come back to the
caller as the same :mod:`services.engines.errors` classes (see :mod:`services.serving.wire.status`);
an aborted request (Abort, a drain, the caller left) is ``RequestAborted`` -> CANCELLED.
"""

from __future__ import annotations


class ServingError(Exception):
    """Base of the errors raised by ``services.serving``."""


class EngineUnreachable(ServingError):
    """The engine at ``target`` could not be reached or stopped answering."""

    def __init__(self, message: str, target: str) -> None:
        super().__init__(message)
        self.target = target


class ProtocolMismatch(ServingError):
    """The engine does not implement the RPC (wrong role) or its answer is unreadable."""


class HostError(ServingError):
    """The engine host cannot go on serving; ``pdserve prefill|decode`` exits non-zero."""


class ReadinessFailed(HostError):
    """The engine's handshake grid turned INVALID, or READY did not come within the bound."""


class RegistrationLost(HostError):
    """The registration was replaced by a newer generation (or vanished before READY)."""
