"""One child process of a pdserve tool, from asyncio: start, READY line, stop, start again.

A :class:`ChildProcess` runs its command in a session of its own (so the terminal's Ctrl-C
reaches only the parent, which stops its children in order, and the process-group id lets it
kill what a child leaves behind: an engine's rank processes), with the parent's environment
plus its own, ``PYTHONUNBUFFERED=1``, optionally pinned to some cores. Its stderr goes to its
log file; its stdout, by :class:`Output`:

- ``READY``: copied line by line into the log, the first ``PDSERVE_READY`` line's payload kept
  in :attr:`ChildProcess.announced` (pdserve engines and the router print one);
- ``CAPTURE``: left to the caller (``child.process.stdout``, ``communicate()``);
- ``DISCARD``: thrown away.

A child also ends when its parent ends, however that ends (SIGKILL included): the kernel sends
it SIGTERM (``PR_SET_PDEATHSIG``, :func:`~services.lifetime.parent_death_preexec`), its own
clean stop. The kernel ties that to the thread that started the child: start children from the
main thread (``pdserve up`` does; one started from another thread goes without it).

Stopping is one rule everywhere: SIGTERM (the process, or its whole group), a bounded wait,
then SIGKILL of the process group, whatever is left of it. :func:`stop_in_order` stops groups
of children one group after the other (``pdserve up``: router, decode, prefill).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from services.lifetime import parent_death_preexec
from services.serving.ready import parse_ready_line

LOG_TAIL_LINES = 20


class Output(enum.Enum):
    """What happens to a child's stdout."""

    READY = "ready"
    CAPTURE = "capture"
    DISCARD = "discard"


class ChildExited(Exception):
    """The child exited while it was waited for (its READY line); the message says how, with the
    end of its log."""


class ChildProcess:
    """One supervised command (see the module docstring); :meth:`start` again restarts it."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        role: str = "",
        env: Mapping[str, str] | None = None,
        cores: set[int] | None = None,
        output: Output = Output.READY,
        append_log: bool = True,
    ) -> None:
        """``env`` is set on top of the parent's environment; ``cores`` pins the child (and so
        its threads and children); ``append_log=False`` empties the log at the first start."""
        self.name = name
        self.role = role
        """A label of the caller's (``pdserve up``: ``prefill``, ``decode`` or ``router``)."""
        self.argv = list(argv)
        self.log_path = log_path
        self.env = dict(env or {})
        self.cores = cores
        self.output = output
        self.process: asyncio.subprocess.Process | None = None
        self.announced: dict[str, Any] | None = None
        """The payload of its READY line in the current run; ``None`` until it printed one."""
        self.started_at: float | None = None
        """``time.monotonic()`` of the current run's start."""
        self.ready_at: float | None = None
        """``time.monotonic()`` when the current run's READY line was read."""
        self.starts = 0
        self._append_log = append_log
        self._reader: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    @property
    def pid(self) -> int:
        assert self.process is not None, f"{self.name} was never started"
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        """The exit status of the current run; ``None`` while it runs (or before a start)."""
        return None if self.process is None else self.process.returncode

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.returncode is None

    def served_s(self) -> float | None:
        """How long the current run has served since its READY line; ``None`` if it printed
        none."""
        if self.ready_at is None:
            return None
        return time.monotonic() - self.ready_at

    async def start(self) -> None:
        """Start the command (again, after an exit: the log is appended to and the previous
        run's announcement forgotten)."""
        assert not self.running, f"{self.name} is running"
        await self._close_reader()
        self.announced = None
        self.ready_at = None
        self._ready = asyncio.Event()
        mode = "ab" if self._append_log or self.starts else "wb"
        cores = self.cores

        def pin() -> None:
            if cores:
                os.sched_setaffinity(0, cores)

        # Two system calls: prctl (dies with this process) and sched_setaffinity. No lock.
        preexec = parent_death_preexec(signal.SIGTERM, then=pin if cores else None)
        stdout = asyncio.subprocess.PIPE if self.output is not Output.DISCARD else None
        with self.log_path.open(mode) as log:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                stdout=stdout if stdout is not None else asyncio.subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,
                preexec_fn=preexec,
                env={**os.environ, **self.env, "PYTHONUNBUFFERED": "1"},
            )
        self.started_at = time.monotonic()
        self.starts += 1
        if self.output is Output.READY:
            self._reader = asyncio.create_task(self._read_output(self.process))

    async def _read_output(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None
        with self.log_path.open("ab") as log:
            async for raw in process.stdout:
                log.write(raw)
                log.flush()
                if self.announced is None:
                    self.announced = parse_ready_line(raw.decode(errors="replace"))
                    if self.announced is not None:
                        self.ready_at = time.monotonic()
                        self._ready.set()

    async def wait_ready(self, timeout_s: float) -> dict[str, Any]:
        """The payload of this run's READY line, once read (``Output.READY`` only).

        Raises :class:`ChildExited` when the run ends first and ``TimeoutError`` after
        ``timeout_s``; neither stops the child.
        """
        assert self.process is not None and self.output is Output.READY
        ready = asyncio.ensure_future(self._ready.wait())
        exited = asyncio.ensure_future(self.process.wait())
        try:
            await asyncio.wait(
                {ready, exited}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            ready.cancel()
            exited.cancel()
        if self.announced is not None:
            return self.announced
        if self.process.returncode is not None:
            raise ChildExited(self.describe_exit())
        raise TimeoutError(f"{self.name} did not announce itself within {timeout_s}s")

    async def communicate(self) -> tuple[bytes, bytes]:
        """``Output.CAPTURE``: its whole stdout once it exits (stderr is in the log: empty)."""
        assert self.process is not None and self.output is Output.CAPTURE
        stdout, _ = await self.process.communicate()
        return stdout, b""

    async def wait(self) -> int:
        """Until the current run ends; its exit status."""
        assert self.process is not None
        return await self.process.wait()

    def send_signal(self, sig: int, *, group: bool = False) -> None:
        """``sig`` to the process (or its whole group); nothing if it is gone."""
        if not self.running:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if group:
                os.killpg(self.pid, sig)
            else:
                os.kill(self.pid, sig)

    async def stop(self, timeout_s: float, *, group: bool = False) -> bool:
        """SIGTERM (the process, or its group with ``group``), wait up to ``timeout_s``, then
        :meth:`kill`; whether it stopped within the bound."""
        if self.process is None:
            return True
        self.send_signal(signal.SIGTERM, group=group)
        clean = await self.wait_bounded(timeout_s)
        await self.kill()
        return clean

    async def kill(self) -> None:
        """SIGKILL whatever is left of its process group; wait for the process and its output."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            await self.process.wait()
        await self._close_reader()

    async def wait_bounded(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the current run to end; whether it did."""
        assert self.process is not None
        try:
            await asyncio.wait_for(self.process.wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def _close_reader(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        """The last ``lines`` lines of its log, indented."""
        with contextlib.suppress(OSError):
            text = self.log_path.read_text(errors="replace")
            return "\n".join(f"    {line}" for line in text.splitlines()[-lines:])
        return "    (no log)"

    def describe_exit(self) -> str:
        return (
            f"{self.name} exited with status {self.returncode}; the end of {self.log_path}:\n"
            f"{self.log_tail()}"
        )


async def stop_in_order(
    groups: Sequence[Sequence[ChildProcess]],
    timeout_s: float,
    *,
    on_late: Callable[[ChildProcess], None] | None = None,
) -> None:
    """Stop ``groups`` one after the other: SIGTERM to every running child of a group, then a
    wait of up to ``timeout_s`` for each (``on_late`` is told of one that does not stop in
    time); finally SIGKILL whatever is left of every child's process group."""
    for group in groups:
        for child in group:
            child.send_signal(signal.SIGTERM)
        for child in group:
            late = child.process is not None and not await child.wait_bounded(timeout_s)
            if late and on_late is not None:
                on_late(child)
    for group in groups:
        for child in group:
            await child.kill()
