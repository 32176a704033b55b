"""The W3C trace context of an incoming HTTP request.

The front end's engine client (:mod:`services.router.frontend.vllm.engine_client`) gets the
``trace_headers`` vLLM's serving classes extract for ``EngineClient.generate``
(:func:`from_vllm`). The context is checked once here, with
:func:`~services.engines.trace_context.parse_trace_context`, and becomes
``GenerationRequest.trace``; an invalid ``traceparent`` (or ``tracestate``) is dropped, not
forwarded, and counted in ``pdserve_router_trace_context_dropped_total{header}``: the request
itself goes on (a tracing header never makes a 400).
"""

from __future__ import annotations

from collections.abc import Mapping

from services.engines.trace_context import (
    TRACEPARENT,
    TRACESTATE,
    TraceContext,
    parse_trace_context,
)
from services.router.metrics import RouterMetrics


def from_vllm(headers: Mapping[str, str] | None, metrics: RouterMetrics) -> TraceContext | None:
    """The trace context of vLLM's ``trace_headers`` (one value per name: vLLM reads the first
    field line of each)."""
    if not headers:
        return None
    parent, state = headers.get(TRACEPARENT), headers.get(TRACESTATE)
    return _checked(
        [parent] if parent is not None else [], [state] if state is not None else [], metrics
    )


def _checked(parents: list[str], states: list[str], metrics: RouterMetrics) -> TraceContext | None:
    if not parents:
        return None
    context, dropped = parse_trace_context(parents, states)
    if dropped is not None:
        metrics.trace_dropped(dropped)
    return context
