"""A real router (uvicorn, real HTTP) in the test's event loop, following a real control plane.

:func:`serving_router` starts :func:`services.router.main.create_app` with the production
lifespan (Redis control plane, gRPC connectors) and uvicorn's production settings
(:func:`services.router.main.uvicorn_config`) on a free port, waits until ``/health`` says
the router can serve (bounded), and stops it cleanly when the block ends. The router serves
vLLM's front end, so ``settings`` names its checkpoint (``tokenizer``; the ``stub_checkpoint``
and ``sim_checkpoint`` fixtures for the synthetic engines) and ``served_model_name``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import uvicorn

from services.router.config import RouterSettings
from services.router.main import create_app, uvicorn_config

START_TIMEOUT_S = 30.0


@contextlib.asynccontextmanager
async def serving_router(
    settings: RouterSettings, *, wait_healthy: bool = True
) -> AsyncIterator[str]:
    """Yield the router's base URL (``http://127.0.0.1:<port>``)."""
    settings = settings.model_copy(update={"host": "127.0.0.1", "port": 0})
    # Off the loop: the first app of a process imports vLLM (seconds of CPU), and the engines
    # the test hosts in this loop must keep their leases meanwhile.
    app = await asyncio.to_thread(create_app, settings)
    server = uvicorn.Server(uvicorn_config(app, settings))
    task = asyncio.create_task(server.serve())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + START_TIMEOUT_S
    try:
        while not server.started:
            if task.done():
                await task
                raise AssertionError("the router stopped before serving")
            assert loop.time() < deadline, "the router did not start in time"
            await asyncio.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        if wait_healthy:
            async with httpx.AsyncClient(base_url=url, timeout=5) as client:
                while (await client.get("/health")).status_code != 200:
                    assert loop.time() < deadline, "the router's /health never turned 200"
                    await asyncio.sleep(0.05)
        yield url
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
