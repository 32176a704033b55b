"""An engine backend registered, heartbeated and READY without a gRPC host around it.

What ``pdserve bench engine`` and the engine integration tests need: the control-plane side of
:class:`~services.serving.host.engine_host.EngineHost` (register the spec, heartbeat, start the
backend, wait for READY; stop, deregister) around a backend that is driven in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from services.config import ControlPlaneSettings
from services.control_plane import EngineState, RedisControlPlane
from services.control_plane.wire import EngineRole
from services.engines.backend import EngineBackend, EngineRegistration

B = TypeVar("B", bound=EngineBackend)

STANDALONE_ENDPOINT = "127.0.0.1:0"
"""The endpoint registered for an engine nobody reaches over gRPC."""


@contextlib.asynccontextmanager
async def registered_engine(
    settings: ControlPlaneSettings,
    backend: B,
    *,
    engine_id: str,
    role: EngineRole,
    ready_timeout_s: float = 60.0,
) -> AsyncIterator[B]:
    """Register ``backend``'s spec, heartbeat it, start it and wait for READY; yield it.

    On exit the backend is stopped, the heartbeat cancelled and the registration withdrawn
    (failures of the last two are ignored: the control plane may already be gone).
    """
    control_plane = RedisControlPlane(settings)
    try:
        record = await control_plane.register(
            backend.describe().spec(engine_id, role, STANDALONE_ENDPOINT)
        )
    except BaseException:
        await control_plane.close()
        raise

    async def heartbeat() -> None:
        while True:
            await asyncio.sleep(settings.heartbeat_interval_s)
            await control_plane.heartbeat(engine_id, record.generation, backend.load())

    beating = asyncio.create_task(heartbeat())
    try:
        await backend.start(EngineRegistration(engine_id, record.generation, role, settings))
        async with control_plane.watch() as watcher:
            await watcher.wait_for(
                engine_id, EngineState.READY, ready_timeout_s, generation=record.generation
            )
        yield backend
    finally:
        await backend.stop()
        beating.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await beating
        with contextlib.suppress(Exception):
            await control_plane.deregister(engine_id, record.generation)
        await control_plane.close()
