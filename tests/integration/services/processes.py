"""``pdserve prefill|decode`` as subprocesses: start, wait for the ready line, stop, clean up.

Each service runs in its own session (process group) so teardown can kill the host and its
rank processes together; a service that dies before its ready line fails the test with its
stderr.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from services.serving.ready import ServingEndpoints, parse_ready_line, pdserve_argv


@dataclass
class ServiceProcess:
    role: str
    engine_id: str
    process: subprocess.Popen[str]
    stderr_path: Path
    endpoints: ServingEndpoints | None = None
    stdout_lines: list[str] = field(default_factory=list)

    @property
    def grpc(self) -> str:
        assert self.endpoints is not None
        return self.endpoints.grpc

    def stderr(self) -> str:
        return self.stderr_path.read_text(errors="replace")[-4000:]

    def wait_ready(self, timeout_s: float) -> ServingEndpoints:
        assert self.process.stdout is not None
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"{self.engine_id} not ready within {timeout_s}s:\n{self.stderr()}"
                    )
                if not selector.select(min(left, 1.0)):
                    continue
                line = self.process.stdout.readline()
                if not line:
                    code = self.process.wait(10)
                    raise AssertionError(
                        f"{self.engine_id} exited with {code} before ready:\n{self.stderr()}"
                    )
                self.stdout_lines.append(line)
                payload = parse_ready_line(line)
                if payload is not None:
                    endpoints = ServingEndpoints.from_payload(payload)
                    self.endpoints = endpoints
                    return endpoints

    def terminate(self) -> None:
        """SIGTERM the host only (what Kubernetes does): it drains and stops its ranks."""
        self.process.send_signal(signal.SIGTERM)

    def kill_tree(self) -> None:
        try:
            self._kill_tree()
        finally:
            if self.process.stdout is not None:
                self.process.stdout.close()

    def _kill_tree(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        else:
            # Ranks of a host that exited must be gone too; kill stragglers.
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)


def start_service(
    role: str,
    *,
    engine_id: str,
    redis_url: str,
    namespace: str,
    work_dir: Path,
    args: Sequence[str] = (),
) -> ServiceProcess:
    stderr_path = work_dir / f"{engine_id}.stderr"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("PDSERVE_GPU_TESTS", None)
    command = pdserve_argv(
        "--log-level",
        "INFO",
        role,
        "--engine-id",
        engine_id,
        "--redis",
        redis_url,
        "--namespace",
        namespace,
        "--listen",
        "127.0.0.1:0",
        *args,
    )
    with stderr_path.open("w") as stderr:
        process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=env,
            start_new_session=True,
        )
    return ServiceProcess(role, engine_id, process, stderr_path)


@contextlib.contextmanager
def running_services(
    specs: Sequence[tuple[str, str, Sequence[str]]],
    *,
    redis_url: str,
    namespace: str,
    work_dir: Path,
    ready_timeout_s: float = 240.0,
) -> Iterator[dict[str, ServiceProcess]]:
    """Start ``(role, engine_id, args)`` services together, wait for all, kill all after."""
    services: dict[str, ServiceProcess] = {}
    try:
        for role, engine_id, args in specs:
            services[engine_id] = start_service(
                role,
                engine_id=engine_id,
                redis_url=redis_url,
                namespace=namespace,
                work_dir=work_dir,
                args=args,
            )
        for service in services.values():
            service.wait_ready(ready_timeout_s)
        yield services
    finally:
        for service in services.values():
            service.kill_tree()
