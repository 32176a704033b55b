"""A short ``pdserve bench goodput`` (issue 32, deliverable 4): the fidelity points, the sweep of
every split of two engines against colocated with its PNG, and the step load with
``--autoscale`` against fixed pools, all in its JSON. Figures are not judged (benchmarks are
measured, not asserted), except that no request is lost."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_bench_goodput_reports_fidelity_sweep_and_step_in_json_with_a_plot(
    tmp_path: Path,
) -> None:
    plot = tmp_path / "goodput.png"
    argv = [
        sys.executable, "-m", "services.cli.main", "bench", "goodput",
        "--fidelity", "--fidelity-input-lengths", "256", "--fidelity-batches", "1,4",
        "--fidelity-contexts", "128",
        "--engines", "2", "--rates", "4", "--duration-s", "2", "--plot", str(plot),
        "--step", "2:3,6:3", "--max-prefill", "2", "--max-decode", "2",
        "--planner-interval-s", "1", "--work-dir", str(tmp_path / "work"),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=280, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout)

    fidelity = report["fidelity"]
    kinds = [(p["kind"], p.get("input_tokens"), p.get("batch")) for p in fidelity["points"]]
    assert kinds == [("ttft", 256, None), ("itl", None, 1), ("itl", None, 4)]
    assert all(p["measured_ms"] > 0 and p["profile_ms"] > 0 for p in fidelity["points"])
    assert fidelity["of"] == 3

    sweep = report["sweep"]
    assert set(sweep["layouts"]) == {"colocated", "1P1D"}
    assert [p["rate"] for p in sweep["layouts"]["1P1D"]] == [4.0]
    (best,) = sweep["best_split_vs_colocated"]
    assert best["best_pd"] == "1P1D" and best["winner"] in ("pd", "colocated", "tie")
    assert report["plot"] == str(plot) and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    step = report["step"]
    for run in ("fixed_max", "autoscale"):
        assert step[run]["requests"] > 0 and step[run]["engine_seconds"] > 0
        assert step[run]["lost_requests"] == 0, step[run]["first_errors"]
    assert step["fixed_max"]["engines_seen"] == [4]
    assert set(step["comparison"]) == {"attainment_points_below_fixed", "engine_seconds_saved"}
