"""``pdserve bench engine --layouts``: parsing, refusals before any engine starts, the report."""

from __future__ import annotations

import argparse

import pytest

from services.bench import engine
from services.bench.engine_layouts import Layouts, layout_rows, parse_layouts


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    engine.add_arguments(parser)
    return parser.parse_args(argv)


def test_layouts_parse_with_the_baseline_first() -> None:
    got = parse_layouts("2x1:2x1, 1x2:1x1,1x1:1x1")
    assert [layouts.name for layouts in got] == ["1x1:1x1", "2x1:2x1", "1x2:1x1"]
    assert got[1] == Layouts((2, 1), (2, 1))
    # Added when missing.
    assert [layouts.name for layouts in parse_layouts("2x1:1x2")] == ["1x1:1x1", "2x1:1x2"]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("2x1", "is not PPxTP:PPxTP"),
        ("2x1:1", "is not PPxTP:PPxTP"),
        ("0x1:1x1", "must be >= 1"),
        ("2x1:2x1,2x1:2x1", "listed twice"),
    ],
)
def test_malformed_layouts_are_refused(text: str, message: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        parse_layouts(text)


def test_layouts_with_single_layout_flags_are_refused() -> None:
    args = parse(["--engine", "vllm", "--layouts", "2x1:2x1", "--decode-tp", "2"])
    with pytest.raises(SystemExit, match="--layouts replaces --decode-tp"):
        engine.run(args)


def test_a_layout_vllm_refuses_is_named_before_any_engine_starts() -> None:
    args = parse(["--engine", "vllm", "--layouts", "1x1:2x1"])  # push mode, decode PP=2
    with pytest.raises(SystemExit, match=r"layout 1x1:2x1: .*needs pull mode"):
        engine.run(args)
    args = parse(["--engine", "vllm", "--transfer-mode", "pull", "--layouts", "1x3:1x1"])
    with pytest.raises(SystemExit, match=r"layout 1x3:1x1: .*TP=3"):
        engine.run(args)


def ttft(read_s: float, reads: int, descriptors: float) -> dict[str, object]:
    return {
        "disaggregated": {
            "kv_transfer_s": read_s,
            "transfers_per_request": reads,
            "descriptors_per_transfer": descriptors,
            "to_first_decode_token_s": 0.1,
            "kv_share": read_s / 0.1,
        },
        "colocated": {"first_token_s": 0.08},
    }


def test_rows_report_each_layout_over_the_baseline() -> None:
    base, pp2 = parse_layouts("2x1:2x1")
    rows = layout_rows([(base, ttft(0.01, 1, 7)), (pp2, ttft(0.015, 2, 3.5))])
    assert [row["layout"] for row in rows] == ["1x1:1x1", "2x1:2x1"]
    assert rows[0]["transfer_vs_baseline"] == 1.0 and rows[0]["read_vs_baseline"] == 1.0
    assert rows[1]["prefill"] == {"pp": 2, "tp": 1}
    assert rows[1]["reads_per_request"] == 2 and rows[1]["descriptors_per_read"] == 3.5
    assert rows[1]["transfer_s_per_request"] == 0.03
    assert rows[1]["transfer_vs_baseline"] == 3.0 and rows[1]["read_vs_baseline"] == 1.5
