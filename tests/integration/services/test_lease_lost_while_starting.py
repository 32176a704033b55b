"""An engine whose lease runs out while it starts (its host stalled past the TTL: a loaded node,
vLLM loading a model) is restored under the same generation, so ranks that were started with it
still publish into it: the engine turns READY at that generation, the restore is counted and no
process exits. Another host having registered the engine id meanwhile stays fatal."""

from __future__ import annotations

import asyncio
import io
from collections.abc import Callable, Iterator

import pytest
from prometheus_client import CollectorRegistry

from services.cli.engine import ROLE_SERVICES
from services.config import ControlPlaneSettings, RedisSettings
from services.control_plane import ControlPlaneMetrics, RedisControlPlane
from services.control_plane.local_redis import LocalRedisServer
from services.control_plane.wire import EngineRole, EngineState
from services.engines.backend import EngineRegistration
from services.engines.stub import StubBackend
from services.serving.host.engine_host import EngineHost
from tests.integration.services.conftest import service_settings

pytestmark = pytest.mark.integration

BOUND_S = 60.0
"""Bound of every wait (events, not timings: the machine may be loaded)."""


class StallingStub(StubBackend):
    """A stub whose start waits for ``proceed`` once it has its registration (the ranks of a
    real engine loading a model meanwhile)."""

    def __init__(self) -> None:
        super().__init__()
        self.registration: EngineRegistration | None = None
        self.starting = asyncio.Event()
        self.proceed = asyncio.Event()

    async def start(self, registration: EngineRegistration) -> None:
        self.registration = registration
        self.starting.set()
        await self.proceed.wait()
        await super().start(registration)


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    return registry.get_sample_value(name, labels) or 0.0


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + BOUND_S
    while True:
        if predicate():
            return
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {BOUND_S}s"
        await asyncio.sleep(0.05)


@pytest.fixture
def cp_settings(namespace: str) -> Iterator[ControlPlaneSettings]:
    with LocalRedisServer() as server:
        yield ControlPlaneSettings(
            redis=RedisSettings(url=server.url, retry_attempts=3, retry_backoff_s=0.05),
            namespace=namespace,
            lease_ttl_s=5.0,
            heartbeat_interval_s=0.5,
            resync_interval_s=0.3,
        )


def start_host(
    cp_settings: ControlPlaneSettings, backend: StubBackend
) -> tuple[EngineHost, asyncio.Event, asyncio.Task[int]]:
    registry = CollectorRegistry()
    host = EngineHost(
        service_settings(cp_settings),
        backend,
        engine_id="slow-start",
        service=ROLE_SERVICES[EngineRole.PREFILL],
        registry=registry,
        ready_output=io.StringIO(),
    )
    stop = asyncio.Event()
    return host, stop, asyncio.create_task(host.run(stop))


async def lease_runs_out_while_starting(cp: RedisControlPlane, backend: StallingStub) -> int:
    """Once ``backend`` is starting, delete its engine's lease keys (what a lease running out
    does, without waiting for the TTL); the generation it was started with."""
    async with asyncio.timeout(BOUND_S):
        await backend.starting.wait()
    assert backend.registration is not None
    generation = backend.registration.generation
    await cp.connection.client.delete(*cp.keys.lease_keys("slow-start", generation))
    return generation


async def test_a_lease_lost_while_starting_is_restored_under_the_same_generation(
    cp_settings: ControlPlaneSettings,
) -> None:
    backend = StallingStub()
    host, stop, task = start_host(cp_settings, backend)
    cp = RedisControlPlane(cp_settings, ControlPlaneMetrics())
    try:
        generation = await lease_runs_out_while_starting(cp, backend)
        labels = {"engine": "slow-start", "role": "prefill"}
        await wait_until(
            lambda: (
                sample(host.registry, "pdserve_engine_registration_restores_total", **labels) >= 1
            ),
            "the restore",
        )
        view = await cp.get_engine("slow-start")
        assert view is not None and view.generation == generation
        assert view.state is EngineState.PENDING

        backend.proceed.set()  # the ranks publish under the generation they were started with
        await wait_until(lambda: host.endpoints is not None or task.done(), "READY")
        assert not task.done(), f"the host exited with {task.result()}"
        assert host.endpoints is not None and host.endpoints.generation == generation
        view = await cp.get_engine("slow-start")
        assert view is not None and view.state is EngineState.READY
        assert view.generation == generation
        failures = "pdserve_engine_heartbeat_failures_total"
        assert sample(host.registry, failures, reason="engine_not_found", **labels) >= 1
    finally:
        backend.proceed.set()
        stop.set()
        code = await asyncio.wait_for(task, 30)
        await cp.close()
    assert code == 0


async def test_a_lease_lost_while_starting_and_taken_by_another_host_is_fatal(
    cp_settings: ControlPlaneSettings,
) -> None:
    backend = StallingStub()
    host, stop, task = start_host(cp_settings, backend)
    cp = RedisControlPlane(cp_settings, ControlPlaneMetrics())
    try:
        await lease_runs_out_while_starting(cp, backend)
        # Another host registers the engine id and goes away again before the restore.
        spec = host.backend.describe().spec("slow-start", EngineRole.PREFILL, "other:1")
        newer = await cp.register(spec)
        await cp.deregister("slow-start", newer.generation)
        async with asyncio.timeout(BOUND_S):
            code = await task
        assert code == 1
        assert host.endpoints is None
    finally:
        backend.proceed.set()
        stop.set()
        if not task.done():
            await asyncio.wait_for(task, 30)
        await cp.close()
