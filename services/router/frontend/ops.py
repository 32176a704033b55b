"""The routes pdserve answers itself beside vLLM's front end: ``GET /health`` and
``GET /metrics``, open (probes and Prometheus), read from the router's runtime.

``/health`` is the router's readiness, not vLLM's (a local engine alive): 200 with the READY
models when the router can serve a request (``Scheduler.ready``: a compatible prefill/decode
pair, or a colocated engine), else 503 with the reason in the OpenAI error envelope. Both say
how the router follows the control plane (``control_plane``: ``reachable``,
``unreachable_s``, the engines ``held`` after an outage): during an outage the router keeps
serving from its last view, so ``/health`` stays 200 while a pair answers.
``/metrics`` is the router's own registry.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.router.errors import NoEngineAvailable
from services.router.runtime import RouterRuntime


async def get_runtime(request: Request) -> RouterRuntime:
    """The app's runtime (``app.state.runtime``, set by its lifespan). ``async``: FastAPI runs
    a plain ``def`` dependency in its thread pool."""
    runtime: RouterRuntime = request.app.state.runtime
    return runtime


Runtime = Annotated[RouterRuntime, Depends(get_runtime)]

ops = APIRouter()


@ops.get("/health")
async def health(runtime: Runtime) -> Response:
    """200 when the router can serve (see ``Scheduler.ready``), else 503 with the reason."""
    pool = runtime.pool
    unreachable_s = pool.control_plane_unreachable_s()
    control_plane = {
        "reachable": unreachable_s == 0,
        "unreachable_s": round(unreachable_s, 1),
        "held": pool.held(),
    }
    if pool.synced and runtime.scheduler.ready():
        return JSONResponse(
            {"status": "ok", "models": pool.ready_models(), "control_plane": control_plane}
        )
    reason = (
        "not synced with the control plane yet"
        if not pool.synced
        else "no READY compatible prefill/decode engine pair and no READY colocated engine"
    )
    if unreachable_s > 0:
        reason += f" (the control plane has been unreachable for {unreachable_s:.0f} s)"
    body: dict[str, object] = {
        **NoEngineAvailable(reason, code="not_ready").envelope(),
        "control_plane": control_plane,
    }
    return JSONResponse(body, status_code=503)


@ops.get("/metrics")
async def metrics(runtime: Runtime) -> Response:
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)
