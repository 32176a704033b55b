"""The suite's time budget, at the end of every run (issue 34): the 20 slowest items (set-up,
call and tear-down of one test together, as a module-scoped stack's start lands on its first
test) and the total per module, slowest first, and a warning when the run passed
:data:`BUDGET_S` (CI gives ``make test`` 90 minutes on a loaded machine; the suite must stay
well inside it). Loaded from ``tests/conftest.py``."""

from __future__ import annotations

import os
import time
from collections import defaultdict

import pytest
from _pytest.terminal import TerminalReporter

BUDGET_S = float(os.environ.get("PDSERVE_TEST_BUDGET_S", str(45 * 60)))
"""``make test`` must stay under this (the developers' guide); a run past it is warned of
(``PDSERVE_TEST_BUDGET_S`` overrides it: the test of this summary)."""
SLOWEST = 20

_item_s: dict[str, float] = defaultdict(float)
_started = [time.monotonic()]


def pytest_sessionstart(session: pytest.Session) -> None:
    _started[0] = time.monotonic()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _item_s[_without_group(report.nodeid)] += report.duration


def _without_group(nodeid: str) -> str:
    """The test's own id: pytest-xdist's ``--dist loadgroup`` appends ``@GROUP`` (its rule: an
    ``@`` after any parameter id's closing bracket)."""
    at = nodeid.rfind("@")
    return nodeid[:at] if at > nodeid.rfind("]") else nodeid


def pytest_terminal_summary(terminalreporter: TerminalReporter) -> None:
    if not _item_s:
        return
    elapsed = time.monotonic() - _started[0]
    write = terminalreporter.write_line
    workers = getattr(terminalreporter.config.option, "numprocesses", None)  # pytest-xdist -n
    side_by_side = f", {workers} workers side by side" if workers else ""
    terminalreporter.section(f"time budget: {elapsed / 60:.1f} min of pytest{side_by_side}")
    by_module: dict[str, float] = defaultdict(float)
    for nodeid, seconds in _item_s.items():
        by_module[nodeid.split("::", 1)[0]] += seconds
    write(f"the {SLOWEST} slowest items (set-up + call + tear-down):")
    for nodeid, seconds in sorted(_item_s.items(), key=lambda kv: -kv[1])[:SLOWEST]:
        write(f"  {seconds:8.1f}s  {nodeid}")
    write("per module, slowest first (a module runs in one worker):")
    for module, seconds in sorted(by_module.items(), key=lambda kv: -kv[1]):
        if seconds >= 1.0:
            write(f"  {seconds:8.1f}s  {module}")
    if elapsed > BUDGET_S:
        write(
            f"WARNING: this run took {elapsed / 60:.1f} min, past the suite's budget of "
            f"{BUDGET_S / 60:.0f} min (docs: README, Tests)",
            yellow=True,
            bold=True,
        )
