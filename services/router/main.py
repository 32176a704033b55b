"""``pdserve router``: the app factory and the process entry point.

``create_app(settings)`` builds a FastAPI app whose lifespan connects to the control plane and
follows it (:meth:`EnginePool.follow`); tests pass a prepared :class:`RouterRuntime` (and no
control plane) instead. :func:`serve` runs it under uvicorn and prints
``PDSERVE_READY {"service": "router", "url": ..., ...}`` once the socket accepts requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import AsyncIterator

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from services.control_plane import ControlPlaneMetrics, RedisControlPlane
from services.router.api import generation, install_error_handlers, ops, v1
from services.router.config import RouterSettings
from services.router.connector import ConnectorFactory, GrpcConnectorFactory
from services.router.metrics import RouterMetrics
from services.router.runtime import RouterRuntime
from services.serving.ready import format_ready_line

logger = logging.getLogger(__name__)

GC_THRESHOLDS = (20_000, 20, 20)
"""The collector's thresholds once the router serves (Python's are (700, 10, 10)): a request
allocates a few hundred container objects, so the default ran a young collection every other
request and a full pass (about 90k objects alive after start-up, ~60 ms) often enough to show
in p99."""


def freeze_startup_objects() -> None:
    """Move everything alive after start-up (modules, app, settings, channels) to the
    permanent generation, which collections skip, and raise the thresholds (see
    :data:`GC_THRESHOLDS`). Cyclic garbage made while serving is still collected."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


def create_app(
    settings: RouterSettings,
    *,
    runtime: RouterRuntime | None = None,
    connectors: ConnectorFactory | None = None,
) -> FastAPI:
    """The router app. With ``runtime``, nothing connects to Redis (the caller feeds the pool);
    otherwise the lifespan builds one with ``connectors`` (gRPC by default)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if runtime is not None:  # set on the app below: nothing to build or close
            yield
            return
        registry = CollectorRegistry()
        factory = connectors or GrpcConnectorFactory(settings.engine_grpc.client_tls())
        built = RouterRuntime.build(settings, factory, RouterMetrics(registry))
        app.state.runtime = built
        control_plane = RedisControlPlane(settings.control_plane, ControlPlaneMetrics(registry))
        follower = asyncio.create_task(built.pool.follow(control_plane), name="pdserve-router-pool")
        try:
            yield
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await built.executor.close()
            await built.pool.close()
            await control_plane.close()

    app = FastAPI(
        title="pdserve router",
        version="1",
        description="OpenAI-compatible front door of pdserve (disaggregated prefill/decode).",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.include_router(generation)
    app.include_router(v1)
    app.include_router(ops)
    install_error_handlers(app)
    if runtime is not None:
        app.state.runtime = runtime
    return app


async def serve(settings: RouterSettings, *, connectors: ConnectorFactory | None = None) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's graceful shutdown)."""
    app = create_app(settings, connectors=connectors)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            await task
            return
        await asyncio.sleep(0.02)
    freeze_startup_objects()
    port = server.servers[0].sockets[0].getsockname()[1]
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    url = f"http://{host}:{port}"
    ready = {"service": "router", "url": url, "port": port, "metrics_url": f"{url}/metrics"}
    print(format_ready_line(ready), flush=True)
    await task
