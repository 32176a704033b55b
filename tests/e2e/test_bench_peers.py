"""``pdserve bench peers`` end to end with its smallest load: vLLM's own PD stack and pdserve's,
one after the other on the tiny checkpoint. Each stack answers every request, uses CPU per
request (the headline figure: summed over every one of its processes, which include both
engines' cores), moves KV with no failed or expired transfer, and gives the same greedy
tokens as the other; nothing it started is left running.

Two vLLM stacks take minutes of CPU to start: opt-in (``PDSERVE_PEERS_TESTS=1``), deselected
from the suite like the image tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.vllm, pytest.mark.peers]


def test_bench_peers_reports_both_stacks_side_by_side(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "services.cli.main", "bench", "peers",
        "--stacks", "peer,pdserve_push", "--rates", "2", "--requests-per-rate", "4",
        "--conversations", "1", "--turns", "2", "--concurrency", "2",
        "--requests-per-concurrency", "2", "--streamed-tokens", "2,6", "--streamed-requests", "2",
        "--no-colocated", "--work-dir", str(tmp_path),
    ]  # fmt: skip
    result = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        timeout=1500,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout)
    for name in ("peer", "pdserve_push"):
        stack = report["stacks"][name]
        assert "phases" in stack, stack
        for phase, figures in stack["phases"].items():
            assert figures["completed"] == figures["requests"] > 0, (name, phase, figures)
            assert figures["cpu_ms_per_request"] > 0, (name, phase)
        assert set(stack["cpu_ms_per_extra_token"]) == {"total", "by_process"}
        labels = " ".join(stack["processes"])
        assert "engine-core" in labels, labels
        assert stack["kv_transfers"].get("transfers", 0) > 0, stack["kv_transfers"]
        assert stack["kv_transfers"].get("failed", 0) == 0
        assert stack["kv_transfers"].get("expired", 0) == 0
    agreement = report["greedy_outputs"]["pdserve_push_vs_peer"]
    assert agreement["equal"] == agreement["compared"] > 0, agreement
    pgrep = ["pgrep", "-f", str(tmp_path)]
    left = subprocess.run(pgrep, capture_output=True, text=True, check=False)
    assert left.stdout == "", f"left running: {left.stdout}"
