"""A short ``pdserve bench goodput`` (issue 32, deliverable 4): the fidelity points (with the
path's overhead from instant engines beside them) and the step load with ``--autoscale``
against fixed pools, all in its JSON. Figures are not judged (benchmarks are measured, not
asserted), except that no request is lost. The rate sweep is the same stack start and load as
the step's fixed pools; its figures and PNG are unit-tested (tests/unit/bench)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_goodput_reports_fidelity_and_step_in_json(tmp_path: Path) -> None:
    argv = [
        sys.executable, "-m", "services.cli.main", "bench", "goodput", "--no-sweep",
        "--fidelity", "--fidelity-input-lengths", "256", "--fidelity-batches", "1,4",
        "--fidelity-contexts", "128",
        "--step", "2:2,6:2", "--max-prefill", "1", "--max-decode", "2",
        "--planner-interval-s", "1", "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)
    assert "sweep" not in report

    fidelity = report["fidelity"]
    kinds = [(p["kind"], p.get("input_tokens"), p.get("batch")) for p in fidelity["points"]]
    assert kinds == [("ttft", 256, None), ("itl", None, 1), ("itl", None, 4)]
    for point in fidelity["points"]:
        assert point["measured_ms"] > 0 and point["profile_ms"] > 0
        assert point["overhead_ms"] >= 0 and "sim_ratio" in point
    (ttft, *itl) = fidelity["points"]
    assert 0 < ttft["overhead_ms"] < ttft["measured_ms"]
    assert all(p["output_tokens"] > 16 and p["effective_batch"] > 0 for p in itl)
    assert fidelity["of"] == 3

    step = report["step"]
    for run in ("fixed_max", "autoscale"):
        assert step[run]["requests"] > 0 and step[run]["engine_seconds"] > 0
        assert step[run]["lost_requests"] == 0, step[run]["first_errors"]
    assert step["fixed_max"]["engines_seen"] == [3]
    assert set(step["comparison"]) == {"attainment_points_below_fixed", "engine_seconds_saved"}
