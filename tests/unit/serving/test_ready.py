"""The ``PDSERVE_READY`` line format (services.serving.ready)."""

from __future__ import annotations

from services.serving.ready import format_ready_line, parse_ready_line


def test_ready_line_round_trips_any_payload() -> None:
    payload = {"service": "router", "url": "http://127.0.0.1:8000", "port": 8000}
    line = format_ready_line(payload)
    assert line.startswith("PDSERVE_READY {")
    assert parse_ready_line(line + "\n") == payload


def test_other_and_malformed_lines_are_not_ready_lines() -> None:
    assert parse_ready_line("INFO: starting") is None
    assert parse_ready_line("PDSERVE_READY {not json") is None
    assert parse_ready_line("PDSERVE_READY [1, 2]") is None
    assert parse_ready_line("PDSERVE_READYX {}") is None
