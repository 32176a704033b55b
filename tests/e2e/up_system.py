"""``pdserve up`` as a subprocess for end-to-end tests: start, wait for endpoints, stop.

Fails fast (with the output) when ``pdserve up`` exits during start-up, waits a bounded time,
and always stops it with SIGINT (its Ctrl-C path), killing the process group as a last resort.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from services.bench.sse import iter_event_data
from services.serving.ready import parse_ready_line
from services.supervision import ChildExited, DetachedProcess

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
        self.up = DetachedProcess.pdserve_up(work_dir, *args, env=env, inherit=inherited)
        self.process = self.up.process
        self.output_path = self.up.output_path
        self.endpoints: dict[str, Any] = {}

    @property
    def returncode(self) -> int | None:
        return self.up.returncode

    def output(self) -> str:
        return self.up.output()

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> UpSystem:
        path = self.work_dir / "endpoints.json"
        try:
            self.up.wait_for_file(path, timeout_s)
        except ChildExited:
            raise AssertionError(f"pdserve up exited early:\n{self.output()}") from None
        except TimeoutError:
            self.stop()
            raise AssertionError(
                f"pdserve up not ready in {timeout_s}s:\n{self.output()}"
            ) from None
        self.endpoints = self.read_endpoints()
        return self

    def read_endpoints(self) -> dict[str, Any]:
        """``endpoints.json`` as it is now (``pdserve up`` rewrites it when it restarts an
        engine)."""
        endpoints: dict[str, Any] = json.loads((self.work_dir / "endpoints.json").read_text())
        return endpoints

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
        return self.up.stop()


def start_router(
    system: UpSystem, *flags: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Another ``pdserve router`` on ``system``'s control plane (a free port, ``flags`` on
    top, ``env`` over this process's environment) and its ``PDSERVE_READY`` payload. The
    caller stops it."""
    argv = [
        sys.executable, "-m", "services.cli.main", "router",
        "--redis", system.endpoints["redis"], "--namespace", system.endpoints["namespace"],
        "--port", "0", *flags,
    ]  # fmt: skip
    router = subprocess.Popen(
        argv, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}
    )
    assert router.stdout is not None
    for line in router.stdout:
        announced = parse_ready_line(line)
        if announced is not None:
            return router, announced
    router.wait(timeout=60)
    raise AssertionError(f"no PDSERVE_READY line (pdserve router exited {router.returncode})")


@contextlib.contextmanager
def healthy_router(
    system: UpSystem, *flags: str, env: dict[str, str] | None = None
) -> Iterator[str]:
    """:func:`start_router`, until its ``/health`` answers 200 (it saw the engines READY):
    its URL; stopped (SIGTERM) at exit."""
    router, announced = start_router(system, *flags, env=env)
    try:
        url = str(announced["url"])
        deadline = time.monotonic() + 60
        while httpx.get(f"{url}/health", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, f"the router at {url} never saw the engines"
            time.sleep(0.2)
        yield url
    finally:
        router.terminate()
        router.wait(timeout=60)
        if router.stdout is not None:
            router.stdout.close()


def hang_up_mid_stream(
    url: str, body: dict[str, Any], *, events: int, headers: dict[str, str] | None = None
) -> httpx.Headers:
    """POST the streamed completion ``body`` to ``url``; the client hangs up (closes the
    connection) after ``events`` data events. Returns the answer's headers (it was a 200)."""
    seen = 0
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream("POST", "/v1/completions", json=body, headers=headers) as response,
    ):
        assert response.status_code == 200, response.read()
        for data in iter_event_data(response):
            seen += data.startswith("{")
            if seen == events:
                break  # leaving both blocks closes the connection mid-stream
    assert seen == events
    return response.headers


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


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), whatever their session."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            with contextlib.suppress(OSError):
                children = [int(child) for child in (task / "children").read_text().split()]
                found.extend(children)
                pending.extend(children)
    return found


def process_tree(pid: int) -> dict[int, str]:
    """``pid`` and every process below it: pid -> start time (``/proc/PID/stat``), which tells
    the process from a later one that reuses its pid."""
    tree = {}
    for member in [pid, *descendants(pid)]:
        started = _start_time(member)
        if started is not None:
            tree[member] = started
    return tree


def still_running(tree: dict[int, str]) -> dict[int, str]:
    """The processes of ``tree`` still there (zombies count as gone): pid -> command line."""
    left = {}
    for pid, started in tree.items():
        if _start_time(pid) == started:
            with contextlib.suppress(OSError):
                command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
                left[pid] = command.decode(errors="replace")[:160]
    return left


def wait_all_gone(tree: dict[int, str], timeout_s: float) -> None:
    """Until no process of ``tree`` runs; AssertionError naming those left after
    ``timeout_s`` (they are then killed, so that nothing leaks into later tests)."""
    deadline = time.monotonic() + timeout_s
    while (left := still_running(tree)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    assert not left, f"still running {timeout_s}s later: {left}"


def _start_time(pid: int) -> str | None:
    """Field 22 of ``/proc/PID/stat`` (``None``: no such process, or a zombie)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
    return None if fields[0] == "Z" else fields[19]
