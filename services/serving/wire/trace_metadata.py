"""A request's W3C trace context as gRPC metadata, both ways: what the router's engine clients
(:mod:`services.serving.client.h2`, :mod:`services.serving.client.grpc_aio`) send with each call of
the request, and what an engine's servicers read back from the call's invocation metadata.

The names are the HTTP headers' (``traceparent``, ``tracestate``), so an OpenTelemetry gRPC
instrumentation would read them too. An engine parses what it receives again
(:func:`~services.engines.trace_context.parse_trace_context`, at its own edge): a context that
is not valid, from whichever caller, is dropped, never an error.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.engines.trace_context import (
    TRACEPARENT,
    TRACESTATE,
    TraceContext,
    parse_trace_context,
)


def to_metadata(trace: TraceContext | None) -> tuple[tuple[str, str], ...]:
    """The metadata of a call that belongs to a request with ``trace`` (none without)."""
    if trace is None:
        return ()
    if trace.tracestate:
        return ((TRACEPARENT, trace.traceparent), (TRACESTATE, trace.tracestate))
    return ((TRACEPARENT, trace.traceparent),)


def from_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> TraceContext | None:
    """The valid trace context among a call's invocation metadata (grpc.aio's
    ``context.invocation_metadata()``), or ``None``."""
    parents: list[str] = []
    states: list[str] = []
    for name, value in metadata or ():
        if name == TRACEPARENT and isinstance(value, str):
            parents.append(value)
        elif name == TRACESTATE and isinstance(value, str):
            states.append(value)
    if not parents:
        return None
    return parse_trace_context(parents, states)[0]
