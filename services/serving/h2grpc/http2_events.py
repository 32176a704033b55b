"""What the HTTP/2 connection (:mod:`~services.serving.h2grpc.http2`) reports to the I/O layer
above the sans-IO core (:mod:`~services.serving.h2grpc.connection`): the :class:`Event` objects
that :meth:`~services.serving.h2grpc.http2.H2ClientConnection.receive` and the calls that end
streams return (the connection settled, a PING answered, a breach, the connection ended...).
Nothing here knows gRPC; the gRPC layer adds its own event (a call changed:
:class:`~services.serving.h2grpc.protocol.StreamChanged`) to the same list.
"""

from __future__ import annotations


class Event:
    """What :meth:`~services.serving.h2grpc.http2.H2ClientConnection.receive` (and the other
    calls that end streams) report."""

    __slots__ = ()


class Settled(Event):
    """The server's first SETTINGS came: its limits are known, streams may start."""

    __slots__ = ()


class SettingsAcknowledged(Event):
    """The server acknowledged the client's SETTINGS."""

    __slots__ = ()


class PingAcknowledged(Event):
    """The server answered the client's PING."""

    __slots__ = ()


class SlotsChanged(Event):
    """Whether a stream may start changed: a stream ended at the server's concurrency limit, the
    limit changed, or a GOAWAY came (no stream starts any more)."""

    __slots__ = ()


class Breach(Event):
    """The server broke the protocol (``violation``: a
    :class:`~services.serving.h2grpc.errors.Violation` label); what it ended is reported too."""

    __slots__ = ("violation",)

    def __init__(self, violation: str) -> None:
        self.violation = violation


class ConnectionEnded(Event):
    """The protocol ended the connection (a connection error, queued GOAWAY included): send what
    :meth:`~services.serving.h2grpc.http2.H2ClientConnection.data_to_send` holds, then close the
    transport. Every stream has ended with ``reason``."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


# The events that carry nothing: one instance each.
SETTLED = Settled()
SETTINGS_ACKNOWLEDGED = SettingsAcknowledged()
PING_ACKNOWLEDGED = PingAcknowledged()
SLOTS_CHANGED = SlotsChanged()
