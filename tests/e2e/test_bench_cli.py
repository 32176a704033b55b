"""``pdserve bench kv --quick --json`` prints parseable JSON alone on stdout (NIXL logs go to
stderr) with positive figures."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_kv_prints_only_json_on_stdout() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "services.cli.main", "bench", "kv", "--quick", "--json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=280,
    )
    report = json.loads(result.stdout)
    assert report["benchmark"] == "kv"
    assert report["results"]
    assert all(r["gbps"] > 0 for r in report["results"])
