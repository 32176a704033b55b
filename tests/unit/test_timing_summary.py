"""The time-budget summary every run ends with (tests/timing.py): slowest items, per-module
totals, and the warning past the budget."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("workers", [None, "2"])
def test_the_summary_lists_slow_items_and_modules_and_warns_past_the_budget(
    tmp_path: Path, workers: str | None
) -> None:
    """Serially, and with pytest-xdist workers (``make test``): the controller sums what every
    worker reported."""
    (tmp_path / "test_a.py").write_text(
        "import time\n\ndef test_slow():\n    time.sleep(0.3)\n\ndef test_quick():\n    pass\n"
    )
    (tmp_path / "test_b.py").write_text(  # a group: pytest-xdist's loadgroup marks its ids
        "import time\n\nimport pytest\n\n\n@pytest.mark.xdist_group('g')\n"
        "def test_b():\n    time.sleep(1.1)\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.timing", "-p", "no:cacheprovider",
         "-q", "--rootdir", str(tmp_path), "-c", os.devnull, str(tmp_path),
         *(["-n", workers, "--dist", "loadgroup"] if workers else [])],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PDSERVE_TEST_BUDGET_S": "1"},
        timeout=120,
        check=False,
    )  # fmt: skip
    out = run.stdout
    assert run.returncode == 0, out + run.stderr
    slowest = out.split("slowest items")[1].split("per module")[0].splitlines()[1:]
    assert "@" not in "".join(slowest), out  # no pytest-xdist group suffix
    assert "test_b.py::test_b" in slowest[0] and "test_a.py::test_slow" in slowest[1], out
    modules = out.split("per module, slowest first")[1].splitlines()[1:]
    assert "test_b.py" in modules[0], out  # 1.1 s; test_a.py (0.3 s) is under the 1 s floor
    assert "past the suite's budget of 0 min" in out, out
    header = next(line for line in out.splitlines() if "time budget:" in line)
    assert ("2 workers side by side" in header) == (workers == "2"), header
