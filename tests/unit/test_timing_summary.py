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
        "def test_b(shared):\n    time.sleep(1.1)\n"
    )
    (tmp_path / "conftest.py").write_text(  # a session stack: its CPU comes at the very end
        "import subprocess, sys\n\nimport pytest\n\n\n@pytest.fixture(scope='session')\n"
        "def shared():\n    yield\n    subprocess.run([sys.executable, '-c', "
        "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.8: pass'],"
        " check=True)\n"
    )
    (tmp_path / "test_c.py").write_text(  # CPU in a process it starts: counted once reaped
        "import subprocess, sys\n\ndef test_burns():\n    subprocess.run([sys.executable, '-c', "
        "'import time\\nt = time.process_time()\\nwhile time.process_time() - t < 1.2: pass'],"
        " check=True)\n"
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
    order = [line.split()[-1].rsplit("/", 1)[-1] for line in slowest if line.strip()]
    assert order.index("test_b.py::test_b") < order.index("test_a.py::test_slow"), out
    modules = [
        line for line in out.split("per module, slowest first")[1].splitlines()[1:]
        if line.strip().endswith(".py")
    ]  # fmt: skip
    listed = {line.split()[-1].rsplit("/", 1)[-1]: line.split() for line in modules if line}
    # A module is listed when its items took the 1 s floor or more: test_b.py and test_c.py
    # always; test_a.py (0.3 s of sleep) only when a loaded machine stretched it past 1 s.
    item_walls = {
        line.split()[-1].rsplit("/", 1)[-1]: float(line.split()[0].rstrip("s"))
        for line in slowest
        if line.strip()
    }
    a_wall = sum(wall for item, wall in item_walls.items() if item.startswith("test_a.py::"))
    assert set(listed) - {"test_a.py"} == {"test_b.py", "test_c.py"}, out
    if abs(a_wall - 1.0) > 0.1:  # (the items' walls are shown rounded to 0.1 s)
        assert ("test_a.py" in listed) == (a_wall > 1.0), out
    walls = [float(line.split()[0].rstrip("s")) for line in modules if line]
    assert walls == sorted(walls, reverse=True), out
    # wall, CPU, "CPU", module: the sleeping test used next to none, the burning one its 1.2 s.
    assert float(listed["test_b.py"][1].rstrip("s")) < 0.5, out
    assert float(listed["test_c.py"][1].rstrip("s")) >= 1.2, out
    # The session fixture's tear-down is not charged to a module: a line of its own.
    session = next(line for line in out.splitlines() if "last tear-down" in line)
    assert float(session.split()[0].rstrip("s")) >= 0.8, out
    assert "past the suite's budget of 0 min" in out, out
    header = next(line for line in out.splitlines() if "time budget:" in line)
    assert ("2 workers side by side" in header) == (workers == "2"), header
