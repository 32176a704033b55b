"""W3C Trace Context (https://www.w3.org/TR/trace-context/) of one request: :class:`TraceContext`.

Where it travels: the router reads ``traceparent`` and ``tracestate`` from a request's HTTP
headers with :func:`parse_trace_context` (an invalid ``traceparent`` is dropped, never an HTTP
error) and sends the result with every engine call of that request as gRPC metadata
(:mod:`services.serving.wire.trace_metadata`). An engine reads the metadata back with the same
function, at its own edge, and hands the context to its backend in the request
(``PrefillRequest.trace``, ``DecodeRequest.trace``): vLLM parents its spans on it
(``trace_headers``, when its OpenTelemetry tracing is configured); the reference engine logs the
trace id. Nothing in pdserve makes spans of its own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"

MAX_TRACESTATE_CHARS = 512
"""The longest ``tracestate`` forwarded (the length every vendor must propagate, W3C 3.3.1.5);
a longer one is dropped whole. It bounds the metadata an engine call carries."""
MAX_TRACESTATE_MEMBERS = 32

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_ZERO_TRACE_ID = "0" * 32
_ZERO_PARENT_ID = "0" * 16
_KEY_CHARS = r"[a-z0-9_\-*/]"
_MEMBER = re.compile(
    rf"(?P<key>[a-z]{_KEY_CHARS}{{0,255}}|[a-z0-9]{_KEY_CHARS}{{0,240}}@[a-z]{_KEY_CHARS}{{0,13}})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_OWS = " \t"


@dataclass(frozen=True)
class TraceContext:
    """A request's valid trace context: what the caller's tracer propagated, passed on as is.

    ``traceparent`` is version 00 (``00-<trace id>-<parent id>-<flags>``, lowercase hex, ids
    not all zero); ``tracestate`` is a valid list of at most :data:`MAX_TRACESTATE_MEMBERS`
    members and :data:`MAX_TRACESTATE_CHARS` characters, or ``""``. Built by
    :func:`parse_trace_context` only.
    """

    traceparent: str
    tracestate: str = ""

    @property
    def trace_id(self) -> str:
        """The 32 hex digits of the trace (what a log line names)."""
        return self.traceparent[3:35]

    def headers(self) -> dict[str, str]:
        """As HTTP headers (vLLM's ``trace_headers``; gRPC metadata has the same names)."""
        if self.tracestate:
            return {TRACEPARENT: self.traceparent, TRACESTATE: self.tracestate}
        return {TRACEPARENT: self.traceparent}


def parse_trace_context(
    traceparent: Sequence[str], tracestate: Sequence[str] = ()
) -> tuple[TraceContext | None, str | None]:
    """The trace context of a request's ``traceparent`` and ``tracestate`` values (every field
    line of each, in order), and the name of the header dropped as invalid (``None`` when none
    was).

    No ``traceparent``: no context (a lone ``tracestate`` means nothing, and is not counted).
    More than one, or one that :func:`parse_traceparent` refuses: no context, ``traceparent``
    dropped (and ``tracestate`` with it, as the spec says). A ``tracestate`` that
    :func:`parse_tracestate` refuses is dropped alone: the context keeps its ``traceparent``.
    """
    if not traceparent:
        return None, None
    parent = parse_traceparent(traceparent[0]) if len(traceparent) == 1 else None
    if parent is None:
        return None, TRACEPARENT
    if not tracestate:
        return TraceContext(parent), None
    state = parse_tracestate(tracestate)
    if state is None:
        return TraceContext(parent), TRACESTATE
    return TraceContext(parent, state), None


def parse_traceparent(value: str) -> str | None:
    """``value`` as a version-00 ``traceparent``, or ``None`` when it is not valid.

    Valid (W3C 3.2): ``version-traceid-parentid-flags`` in lowercase hex (2, 32, 16 and 2
    digits), version not ``ff``, neither id all zeros; version 00 ends after its flags. A later
    version is read as the spec says: its first four fields, then only ``-...`` may follow; it
    is passed on as version 00 (what an OpenTelemetry propagator writes after reading it)."""
    value = value.strip(_OWS)
    match = _TRACEPARENT.match(value)
    if match is None:
        return None
    version, trace_id, parent_id, flags = match.groups()
    rest = value[match.end() :]
    if version == "ff" or trace_id == _ZERO_TRACE_ID or parent_id == _ZERO_PARENT_ID:
        return None
    if version == "00":
        return None if rest else value
    if rest and not rest.startswith("-"):
        return None
    return f"00-{trace_id}-{parent_id}-{flags}"


def parse_tracestate(values: Sequence[str]) -> str | None:
    """The ``tracestate`` of ``values`` (its field lines, joined with ``,`` as HTTP combines
    them) with blank members and optional whitespace removed, or ``None`` when it is not valid
    (W3C 3.3): a member that is not ``key=value``, a key twice, more than
    :data:`MAX_TRACESTATE_MEMBERS` members, or longer than :data:`MAX_TRACESTATE_CHARS`."""
    members = [m.strip(_OWS) for value in values for m in value.split(",")]
    members = [m for m in members if m]
    if len(members) > MAX_TRACESTATE_MEMBERS:
        return None
    keys: set[str] = set()
    for member in members:
        match = _MEMBER.fullmatch(member)
        if match is None or match["key"] in keys:
            return None
        keys.add(match["key"])
    state = ",".join(members)
    return state if len(state) <= MAX_TRACESTATE_CHARS else None
