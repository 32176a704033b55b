"""The suite's time budget, at the end of every run (issue 34): the 20 slowest items (set-up,
call and tear-down of one test together, as a module-scoped stack's start lands on its first
test) and the total per module, slowest first, with the CPU each module used, and a warning
when the run passed :data:`BUDGET_S` (CI gives ``make test`` 90 minutes on a loaded machine;
the suite must stay well inside it). Loaded from ``tests/conftest.py``.

CPU is the figure that does not move with the machine's load or with what the other worker
runs beside: each phase of an item (set-up, call, tear-down) carries, in its report's
``user_properties``, the CPU seconds its test process and every process it started and
reaped used since the last phase ended (``getrusage`` of ``RUSAGE_SELF`` and
``RUSAGE_CHILDREN``: a process counts once reaped, with the descendants it reaped; one that
outlives its parent unreaped counts nowhere). The tear-down that stops the shared stacks
(``tests/e2e/conftest.py``: after their group's last item, :func:`shared_stacks_stop_here`) and
a worker's last tear-down (what is left of the session-scoped fixtures) end processes that
served several modules: their CPU (with that of the module's own fixtures, which end there too)
is shown on a line of its own, not charged to the module that happened to run last."""

from __future__ import annotations

import os
import resource
import time
from collections import defaultdict
from collections.abc import Generator
from typing import Any

import pytest
from _pytest.terminal import TerminalReporter

BUDGET_S = float(os.environ.get("PDSERVE_TEST_BUDGET_S", str(45 * 60)))
"""``make test`` must stay under this (the developers' guide); a run past it is warned of
(``PDSERVE_TEST_BUDGET_S`` overrides it: the test of this summary)."""
SLOWEST = 20

_item_s: dict[str, float] = defaultdict(float)
_module_cpu_s: dict[str, float] = defaultdict(float)
_started = [time.monotonic()]
_last_cpu_s = [0.0]
_session_cpu_s = [0.0]
_last_item = [False]
CPU_PROPERTY = "cpu_s"
SESSION_CPU_PROPERTY = "session_teardown_cpu_s"


def _cpu_s() -> float:
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime


def pytest_sessionstart(session: pytest.Session) -> None:
    _started[0] = time.monotonic()
    _last_cpu_s[0] = _cpu_s()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    _last_item[0] = nextitem is None  # this tear-down ends the session's fixtures too


def shared_stacks_stop_here() -> None:
    """Called in a tear-down that stops processes several modules shared: its CPU goes on
    the session line, as a worker's last tear-down's does."""
    _last_item[0] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, Any, None]:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    now = _cpu_s()
    last = call.when == "teardown" and _last_item[0]
    report.user_properties.append(
        (SESSION_CPU_PROPERTY if last else CPU_PROPERTY, now - _last_cpu_s[0])
    )
    _last_cpu_s[0] = now


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    nodeid = _without_group(report.nodeid)
    _item_s[nodeid] += report.duration
    for name, value in report.user_properties:
        if name == CPU_PROPERTY:
            _module_cpu_s[nodeid.split("::", 1)[0]] += float(str(value))
        elif name == SESSION_CPU_PROPERTY:
            _session_cpu_s[0] += float(str(value))


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
    cpu_total = sum(_module_cpu_s.values()) + _session_cpu_s[0]
    write(
        f"per module, slowest first (a module runs in one worker; CPU: its test process and "
        f"what it started, {cpu_total:.0f} s in all):"
    )
    for module, seconds in sorted(by_module.items(), key=lambda kv: -kv[1]):
        if seconds >= 1.0:
            write(f"  {seconds:8.1f}s  {_module_cpu_s.get(module, 0.0):8.1f}s CPU  {module}")
    if _session_cpu_s[0]:
        write(
            f"  {'':9s}  {_session_cpu_s[0]:8.1f}s CPU  (each worker's last tear-down and the "
            "one that stops the shared stacks: what they end and their module's, reaped there)"
        )
    if elapsed > BUDGET_S:
        write(
            f"WARNING: this run took {elapsed / 60:.1f} min, past the suite's budget of "
            f"{BUDGET_S / 60:.0f} min (docs: README, Tests)",
            yellow=True,
            bold=True,
        )
