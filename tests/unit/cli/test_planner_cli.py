"""``pdserve planner``'s flags: parsed without importing the planner, laid over its environment
settings, and refused when they disagree."""

from __future__ import annotations

import subprocess
import sys

import pytest
from pydantic import ValidationError

from services.cli.main import build_parser
from services.cli.planner import build_settings


def test_building_the_parser_does_not_import_the_planner() -> None:
    probe = (
        "import sys; from services.cli.main import build_parser; build_parser(); "
        "print(sorted(m for m in sys.modules if m.startswith('services.planner')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert done.stdout.strip() == "[]"


def test_flags_override_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_PLANNER_ITL_MS", "30")
    monkeypatch.setenv("PDSERVE_PLANNER_DECODE_MAX", "12")
    args = build_parser().parse_args(
        ["planner", "--router-url", "http://r:9", "--ttft-ms", "300", "--predictor", "ema",
         "--decode-max", "6", "--prefill-min", "2", "--prefill-max", "2"]
    )  # fmt: skip
    settings = build_settings(args)
    assert (settings.router_url, settings.ttft_ms, settings.itl_ms) == ("http://r:9", 300, 30)
    assert (settings.predictor, settings.decode_max, settings.prefill_min) == ("ema", 6, 2)


def test_a_minimum_above_the_maximum_is_refused() -> None:
    args = build_parser().parse_args(["planner", "--decode-min", "5", "--decode-max", "4"])
    with pytest.raises(ValidationError, match="decode_min"):
        build_settings(args)


def test_the_engine_load_limits_are_flags() -> None:
    default = build_settings(build_parser().parse_args(["planner"]))
    assert (default.kv_usage_limit, default.prefill_queue_limit) == (0.9, None)
    args = build_parser().parse_args(
        ["planner", "--kv-usage-limit", "0.8", "--prefill-queue-limit", "4"]
    )
    settings = build_settings(args)
    assert (settings.kv_usage_limit, settings.prefill_queue_limit) == (0.8, 4)
    with pytest.raises(ValidationError, match="kv_usage_limit"):
        build_settings(build_parser().parse_args(["planner", "--kv-usage-limit", "1.5"]))


def test_the_cached_share_is_read_unless_the_flag_says_not_to(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert build_settings(build_parser().parse_args(["planner"])).cached_tokens is True
    off = build_parser().parse_args(["planner", "--no-cached-tokens"])
    assert build_settings(off).cached_tokens is False
    monkeypatch.setenv("PDSERVE_PLANNER_CACHED_TOKENS", "false")
    on = build_parser().parse_args(["planner", "--cached-tokens"])
    assert build_settings(on).cached_tokens is True
