"""W3C Trace Context parsing (services/engines/trace_context.py): what is passed on, what is
dropped and which header is named when it is, against the spec's examples and its rules."""

from __future__ import annotations

import pytest

from services.engines.trace_context import (
    MAX_TRACESTATE_CHARS,
    TraceContext,
    parse_trace_context,
    parse_traceparent,
    parse_tracestate,
)

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
VALID = f"00-{TRACE_ID}-{PARENT_ID}-01"  # the spec's own example


@pytest.mark.parametrize(
    ("value", "forwarded"),
    [
        (VALID, VALID),
        (f"00-{TRACE_ID}-{PARENT_ID}-00", f"00-{TRACE_ID}-{PARENT_ID}-00"),
        (f" {VALID}\t", VALID),  # HTTP's optional whitespace
        # A later version: its four fields, read as version 00 (an OpenTelemetry propagator's
        # rule), whatever follows a dash ignored.
        (f"cc-{TRACE_ID}-{PARENT_ID}-01", f"00-{TRACE_ID}-{PARENT_ID}-01"),
        (f"cc-{TRACE_ID}-{PARENT_ID}-01-what-the-future-holds", f"00-{TRACE_ID}-{PARENT_ID}-01"),
    ],
)
def test_a_valid_traceparent_is_forwarded_as_version_00(value: str, forwarded: str) -> None:
    assert parse_traceparent(value) == forwarded


@pytest.mark.parametrize(
    "value",
    [
        "",
        "00",
        VALID.upper(),  # lowercase hex only
        f"00-{TRACE_ID.upper()}-{PARENT_ID}-01",
        f"00-{'0' * 32}-{PARENT_ID}-01",  # all-zero trace id
        f"00-{TRACE_ID}-{'0' * 16}-01",  # all-zero parent id
        f"ff-{TRACE_ID}-{PARENT_ID}-01",  # the forbidden version
        f"00-{TRACE_ID}-{PARENT_ID}-01-extra",  # version 00 ends at its flags
        f"00-{TRACE_ID}-{PARENT_ID}-1",
        f"00-{TRACE_ID[:-1]}-{PARENT_ID}-01",
        f"00-{TRACE_ID}-{PARENT_ID}0-01",
        f"00_{TRACE_ID}_{PARENT_ID}_01",
        f"0x-{TRACE_ID}-{PARENT_ID}-01",
        f"cc-{TRACE_ID}-{PARENT_ID}-01.x",  # a later version: only "-..." may follow
        f"00-{TRACE_ID[:-1]}\u00e9-{PARENT_ID}-01",
    ],
)
def test_an_invalid_traceparent_is_refused(value: str) -> None:
    assert parse_traceparent(value) is None


def test_tracestate_is_normalised_and_checked_member_by_member() -> None:
    assert parse_tracestate(["rojo=00f067aa0ba902b7, congo=t61rcWkgMzE"]) == (
        "rojo=00f067aa0ba902b7,congo=t61rcWkgMzE"
    )
    # Several field lines are one list; blank members are allowed and removed.
    assert parse_tracestate(["a=1,,", " b=2 ", "tenant@sys=x y"]) == "a=1,b=2,tenant@sys=x y"
    assert parse_tracestate(["", " "]) == ""
    assert parse_tracestate(["a=1 "]) == "a=1"  # the member's whitespace, not the value's
    assert parse_tracestate(["k=" + "v" * 256]) == "k=" + "v" * 256  # the longest value
    for bad in (
        ["a=1,a=2"],  # a key twice
        ["A=1"],  # keys are lowercase
        ["a"],  # no value
        ["a=b=c"],  # '=' is not a value character
        ["a=\u00e9"],
        ["@sys=1"],
        [",".join(f"k{i}=v" for i in range(33))],  # more than 32 members
        ["k=" + "v" * 257],  # a value of at most 256 characters
        ["k=v v,k2= "],  # a value is never empty
    ):
        assert parse_tracestate(bad) is None, bad
    # Valid members, but longer than pdserve forwards: dropped whole.
    long = [",".join(f"k{i}={'v' * 30}" for i in range(20))]
    assert len(long[0]) > MAX_TRACESTATE_CHARS
    assert parse_tracestate(long) is None


def test_the_context_names_the_header_it_dropped() -> None:
    context = TraceContext(VALID, "rojo=1")
    assert parse_trace_context([VALID], ["rojo=1"]) == (context, None)
    assert context.trace_id == TRACE_ID
    assert context.headers() == {"traceparent": VALID, "tracestate": "rojo=1"}
    assert TraceContext(VALID).headers() == {"traceparent": VALID}
    assert parse_trace_context([], []) == (None, None)
    assert parse_trace_context([], ["rojo=1"]) == (None, None)  # nothing to attach it to
    # An invalid traceparent takes tracestate with it (the spec: never one without the other).
    assert parse_trace_context(["00-bad"], ["rojo=1"]) == (None, "traceparent")
    assert parse_trace_context([VALID, VALID], []) == (None, "traceparent")  # one header only
    # An invalid tracestate goes alone.
    assert parse_trace_context([VALID], ["a=1,a=2"]) == (TraceContext(VALID), "tracestate")
