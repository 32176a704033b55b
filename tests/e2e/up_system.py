"""``pdserve up`` as a subprocess for end-to-end tests: start, wait for endpoints, stop.

Fails fast (with the output) when ``pdserve up`` exits during start-up, waits a bounded time,
and always stops it with SIGINT (its Ctrl-C path), killing the process group as a last resort.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx

from services.serving.ready import pdserve_argv

START_TIMEOUT_S = 240.0


class UpSystem:
    """A running ``pdserve up``; ``endpoints`` is its ``endpoints.json``."""

    def __init__(
        self,
        work_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
        scrub_env: bool = False,
    ) -> None:
        """``env`` overrides the inherited environment; ``scrub_env`` first drops every
        ``PDSERVE_*`` variable of it, so no developer setting points the stack elsewhere."""
        inherited = {
            key: value
            for key, value in os.environ.items()
            if not (scrub_env and key.startswith("PDSERVE_"))
        }
        self.work_dir = work_dir
        self.output_path = work_dir / "up.out"
        work_dir.mkdir(parents=True, exist_ok=True)
        self._output = self.output_path.open("wb")
        self.process = subprocess.Popen(
            pdserve_argv("up", "--work-dir", str(work_dir), "--port", "0", *args),
            stdout=self._output,
            stderr=subprocess.STDOUT,
            env={**inherited, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
        )
        self.endpoints: dict[str, Any] = {}
        self.returncode: int | None = None

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> UpSystem:
        path = self.work_dir / "endpoints.json"
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            if self.process.poll() is not None:
                raise AssertionError(f"pdserve up exited early:\n{self.output()}")
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"pdserve up not ready in {timeout_s}s:\n{self.output()}")
            time.sleep(0.2)
        self.endpoints = json.loads(path.read_text())
        return self

    @property
    def url(self) -> str:
        return str(self.endpoints["router"])

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the router's /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            series, _, value = line.rpartition(" ")
            label_part = series[len(name) :]
            if label_part in ("", "{}") and not labels:
                return float(value)
            if label_part.startswith("{"):
                present = ",".join(sorted(label_part[1:-1].split(",")))
                if present == wanted:
                    total += float(value)
        return total

    def stop(self) -> int:
        """Ctrl-C, a bounded wait, then kill the whole group."""
        if self.returncode is not None:
            return self.returncode
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._output.close()
        self.returncode = self.process.returncode
        return self.returncode


def no_processes_left(pids: list[int]) -> list[int]:
    """The pids (process groups) still alive; empty when everything stopped."""
    alive = []
    for pid in pids:
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            continue
        except PermissionError:
            pass
        alive.append(pid)
    return alive
