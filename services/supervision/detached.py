"""A whole ``pdserve up`` (or any command) run from synchronous code: benchmarks and tests.

:class:`DetachedProcess` starts the command in a session of its own with stdout and stderr in
one file, waits for a file it writes (``pdserve up``'s ``endpoints.json``) while failing fast
when it exits, and stops it as a person would: SIGINT (Ctrl-C, its clean stop path), a bounded
wait, then SIGKILL of its whole process group. It gets the same SIGINT from the kernel when
the process that started it ends without stopping it (a benchmark or test run killed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from services.lifetime import parent_death_preexec
from services.serving.ready import pdserve_argv
from services.supervision.child import ChildExited

STOP_TIMEOUT_S = 150.0
"""Bound of :meth:`DetachedProcess.stop` before SIGKILL. ``pdserve up`` stops its router, its
decode engines and its prefill engines in turn, each within ``--stop-timeout-s`` (30 s by
default), then Redis and Prometheus: a vLLM stack on a loaded machine can take most of 90 s
(60 s here killed a clean stop mid-way, seen once in ``make test`` under load)."""


class DetachedProcess:
    """A running command (see the module docstring); :meth:`stop` always ends it."""

    def __init__(self, argv: Sequence[str], output_path: Path, env: Mapping[str, str]) -> None:
        """Start ``argv`` with exactly ``env``, its stdout and stderr in ``output_path``."""
        self.output_path = output_path
        with output_path.open("wb") as output:
            self.process = subprocess.Popen(
                list(argv),
                stdout=output,
                stderr=subprocess.STDOUT,
                env=dict(env),
                start_new_session=True,
                # Ends with this process however it ends (one prctl call: takes no lock).
                preexec_fn=parent_death_preexec(signal.SIGINT),  # noqa: PLW1509
            )
        self.returncode: int | None = None
        """Set by :meth:`stop`."""

    @classmethod
    def pdserve_up(
        cls,
        work_dir: Path,
        *args: str,
        env: Mapping[str, str] | None = None,
        inherit: Mapping[str, str] | None = None,
    ) -> DetachedProcess:
        """``pdserve up --work-dir WORK_DIR --port 0 ARGS``, its output in
        ``WORK_DIR/up.out``; the environment is ``inherit`` (default: this process's) with
        ``PYTHONUNBUFFERED=1`` and ``env`` on top."""
        work_dir.mkdir(parents=True, exist_ok=True)
        base = os.environ if inherit is None else inherit
        return cls(
            pdserve_argv("up", "--work-dir", str(work_dir), "--port", "0", *args),
            work_dir / "up.out",
            {**base, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def poll(self) -> int | None:
        return self.process.poll()

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_for_file(self, path: Path, timeout_s: float) -> None:
        """Until ``path`` exists. Raises :class:`ChildExited` when the process exits first and
        ``TimeoutError`` after ``timeout_s`` (neither stops it)."""
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.process.poll() is not None:
                raise ChildExited(f"exited with status {self.process.returncode}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no {path.name} within {timeout_s}s")
            time.sleep(0.2)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """Ctrl-C (SIGINT), up to ``timeout_s`` to exit, then SIGKILL of the whole group; the
        exit status. Idempotent."""
        if self.returncode is not None:
            return self.returncode
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.returncode = self.process.returncode
        return self.returncode
