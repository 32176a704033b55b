"""Processes of a benchmark: start them (pinned to chosen cores; the one supervisor,
:class:`~services.supervision.ChildProcess`), stop them, and read the CPU time they used from
``/proc``.

CPU time is the figure that does not depend on who else shares the machine: the CPU-time clock
of each process (every thread) and of its descendants, read before and after a measured window.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

from services.supervision import ChildExited, ChildProcess, Output

START_TIMEOUT_S = 120.0
STOP_TIMEOUT_S = 15.0
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    return text[text.rindex(")") + 2 :].split()


def children_with_arg(pid: int, arg: str) -> list[int]:
    """The live processes whose parent is ``pid`` and whose command line holds ``arg``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is None or int(fields[1]) != pid:
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if arg.encode() in argv:
            found.append(int(entry.name))
    return found


def descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        fields = _stat_fields(int(entry.name))
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found = [pid]
    for parent in found:
        found.extend(children.get(parent, ()))
    return found


def process_cpu_clock(pid: int) -> int:
    """Linux's CPU-time clock of process ``pid`` (what ``clock_getcpuclockid(3)`` returns:
    ``MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)``), for :func:`time.clock_gettime`."""
    return ((~pid) << 3) | 2


def cpu_seconds(pids: Iterable[int]) -> float:
    """CPU seconds used so far by ``pids`` (every thread, exited ones included); processes that
    are gone count 0.

    Read from each process's CPU-time clock, in nanoseconds: ``utime + stime`` of
    ``/proc/<pid>/stat`` counts 10 ms ticks, coarser than a fast router's CPU over a short
    window (a Rust router serving a few hundred requests can use less than one tick). Where
    the clock cannot be read (not Linux), the ticks are used.
    """
    total = 0.0
    for pid in pids:
        try:
            total += time.clock_gettime(process_cpu_clock(pid))
        except OSError:
            fields = _stat_fields(pid)
            if fields is not None:
                # After the command: state ppid pgrp session tty tpgid flags minflt cminflt
                # majflt cmajflt utime stime (fields 14 and 15 of proc(5)).
                total += (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    return total


def load_average() -> list[float]:
    return list(os.getloadavg())


PIN_MIN_CORES = 4
"""Pinning by default needs this many cores: with fewer, the stubs and the load generator
crowded onto what the router leaves wait on anything else the machine runs (on a shared
2-core machine pinning tripled the sequential latency of both systems)."""


def core_split(cores: int | None = None) -> tuple[set[int], set[int]] | None:
    """``(router cores, everything else's cores)``: the first allowed core for the router under
    test and the rest for the load generator and the stub engines; ``None`` (no pinning) with
    fewer than ``PIN_MIN_CORES`` allowed cores, or fewer than 2 when ``cores`` forces it."""
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < (cores or PIN_MIN_CORES) or len(allowed) < 2:
        return None
    return {allowed[0]}, set(allowed[1:])


async def start(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    *,
    cores: set[int] | None = None,
    wait_ready_line: bool = False,
    capture_stdout: bool = False,
    env: dict[str, str] | None = None,
) -> ChildProcess:
    """Start ``argv`` in its own process group, on ``cores`` (inherited by its threads and
    children), stderr to ``log_dir/<name>.log``; with ``wait_ready_line``, wait up to
    ``START_TIMEOUT_S`` for its ``PDSERVE_READY`` line (its stdout then goes to the log too);
    with ``capture_stdout``, its stdout is the caller's to read; ``env`` over this process's
    environment. Stop it with :func:`stop`."""
    output = Output.DISCARD
    if wait_ready_line:
        output = Output.READY
    elif capture_stdout:
        output = Output.CAPTURE
    service = ChildProcess(
        name, argv, log_dir / f"{name}.log", env=env, cores=cores, output=output, append_log=False
    )
    await service.start()
    if not wait_ready_line:
        return service
    try:
        await service.wait_ready(START_TIMEOUT_S)
    except (ChildExited, TimeoutError):
        await stop(service)
        raise RuntimeError(
            f"{name} did not announce itself within {START_TIMEOUT_S}s (exit status "
            f"{service.returncode}); the end of its stderr ({service.log_path}):\n"
            f"{service.log_tail()}"
        ) from None
    return service


async def stop(service: ChildProcess) -> None:
    """SIGTERM its process group, up to ``STOP_TIMEOUT_S``, then SIGKILL what is left."""
    await service.stop(STOP_TIMEOUT_S, group=True)
