"""In-process engine hosts (real gRPC server, real Redis control plane) over the stub engine."""

from __future__ import annotations

import asyncio
import contextlib
import io
from collections.abc import AsyncIterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from services.cli.engine import ROLE_SERVICES
from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.backend import EngineBackend
from services.serving.host.config import EngineServiceSettings, GrpcServerSettings
from services.serving.host.engine_host import EngineHost
from services.serving.ready import ServingEndpoints

START_TIMEOUT_S = 30.0


@dataclass
class RunningHost:
    host: EngineHost
    stop: asyncio.Event
    task: asyncio.Task[int]
    endpoints: ServingEndpoints
    ready_output_at_ready: list[str]
    """What the host had written to its ready output each time its ``on_ready`` ran."""

    async def exit_code(self, timeout_s: float = 30.0) -> int:
        return await asyncio.wait_for(asyncio.shield(self.task), timeout_s)


def service_settings(cp_settings: ControlPlaneSettings, **update: object) -> EngineServiceSettings:
    values: dict[str, object] = {
        "control_plane": cp_settings,
        "grpc": GrpcServerSettings(listen="127.0.0.1:0"),
        "metrics_port": 0,
        "metrics_host": "127.0.0.1",
        "drain_timeout_s": 10.0,
        "ready_timeout_s": 10.0,
    }
    values.update(update)
    return EngineServiceSettings.model_validate(values)


@contextlib.asynccontextmanager
async def hosted(
    settings: EngineServiceSettings,
    backend: EngineBackend,
    *,
    engine_id: str,
    role: EngineRole,
) -> AsyncIterator[RunningHost]:
    """Run an :class:`EngineHost` until the block ends (then a clean stop, exit code 0 or
    whatever a test already made it return)."""
    ready_output = io.StringIO()
    ready_output_at_ready: list[str] = []
    host = EngineHost(
        settings,
        backend,
        engine_id=engine_id,
        service=ROLE_SERVICES[role],
        registry=CollectorRegistry(),
        ready_output=ready_output,
        on_ready=lambda: ready_output_at_ready.append(ready_output.getvalue()),
    )
    stop = asyncio.Event()
    task = asyncio.create_task(host.run(stop))
    deadline = asyncio.get_running_loop().time() + START_TIMEOUT_S
    while host.endpoints is None:
        if task.done():
            raise AssertionError(f"host {engine_id} exited with {task.result()} before READY")
        assert asyncio.get_running_loop().time() < deadline, f"{engine_id} not READY in time"
        await asyncio.sleep(0.02)
    running = RunningHost(host, stop, task, host.endpoints, ready_output_at_ready)
    try:
        yield running
    finally:
        stop.set()
        # A host that fails or hangs on stop fails the test.
        await asyncio.wait_for(task, 30)
