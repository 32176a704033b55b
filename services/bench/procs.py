"""Processes of a benchmark: start them (pinned to chosen cores), wait for them, stop them,
and read the CPU time they used from ``/proc``.

CPU time is the figure that does not depend on who else shares the machine: ``utime + stime``
of every thread of a process and of its descendants, read before and after a measured window.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.serving.ready import parse_ready_line

START_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 20
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    return text[text.rindex(")") + 2 :].split()


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


def cpu_seconds(pids: Iterable[int]) -> float:
    """User + system CPU seconds used so far by ``pids`` (all their threads); processes that
    are gone count 0."""
    ticks = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            # After the command: state ppid pgrp session tty tpgid flags minflt cminflt majflt
            # cmajflt utime stime (fields 14 and 15 of proc(5)).
            ticks += int(fields[11]) + int(fields[12])
    return ticks / _CLOCK_TICKS


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


@dataclass
class Service:
    name: str
    process: asyncio.subprocess.Process
    log_path: Path
    """Its stderr."""
    announced: dict[str, Any] | None = None

    @property
    def pids(self) -> list[int]:
        """The process and its descendants (a launcher's child does the work)."""
        return descendants(self.process.pid)

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 15)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            return "\n".join(f"    {line}" for line in text.splitlines()[-lines:])
        return "    (no log)"


async def start(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    *,
    cores: set[int] | None = None,
    wait_ready_line: bool = False,
    capture_stdout: bool = False,
) -> Service:
    """Start ``argv`` in its own process group, on ``cores`` (inherited by its threads and
    children), stderr to ``log_dir/<name>.log``; with ``wait_ready_line``, wait up to
    ``START_TIMEOUT_S`` for its ``PDSERVE_READY`` line."""
    log_path = log_dir / f"{name}.log"

    def pin() -> None:
        if cores:
            os.sched_setaffinity(0, cores)

    piped = wait_ready_line or capture_stdout
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            *argv,
            stdout=asyncio.subprocess.PIPE if piped else asyncio.subprocess.DEVNULL,
            stderr=log,
            start_new_session=True,
            preexec_fn=pin,  # only sched_setaffinity: nothing that takes a lock
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    service = Service(name, process, log_path)
    if not wait_ready_line:
        return service
    with contextlib.suppress(TimeoutError):
        service.announced = await asyncio.wait_for(_ready_line(process), START_TIMEOUT_S)
    if service.announced is None:
        await service.stop()
        raise RuntimeError(
            f"{name} did not announce itself within {START_TIMEOUT_S}s (exit status "
            f"{process.returncode}); the end of its stderr ({log_path}):\n{service.log_tail()}"
        )
    return service


async def _ready_line(process: asyncio.subprocess.Process) -> dict[str, Any] | None:
    """The payload of the process's ready line; ``None`` if its stdout ends first."""
    assert process.stdout is not None
    while line := await process.stdout.readline():
        announced = parse_ready_line(line.decode(errors="replace"))
        if announced is not None:
            return announced
    return None
