"""``pdserve router``: the app factory and the process entry point.

``create_app(settings)`` builds a FastAPI app whose lifespan connects to the control plane and
follows it (:meth:`EnginePool.follow`); tests pass a prepared :class:`RouterRuntime` (and no
control plane) instead. :func:`serve` runs it under uvicorn and prints
``PDSERVE_READY {"service": "router", "url": ..., ...}`` once the socket accepts requests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
import uvloop
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from services.control_plane import ControlPlaneMetrics, RedisControlPlane
from services.engines.vllm.version_guard import (
    FRONTEND_INSTANCE_ATTRIBUTES,
    FRONTEND_SYMBOLS,
    check_vllm,
)
from services.lifetime import freeze_startup_heap
from services.router.config import RouterSettings
from services.router.frontend.http_protocol import CoalescingHttpToolsProtocol
from services.router.frontend.ops import ops
from services.router.metrics import RouterMetrics
from services.router.runtime import RouterRuntime
from services.router.scheduling.connector import ConnectorFactory, GrpcConnectorFactory
from services.serving.ready import format_ready_line

logger = logging.getLogger(__name__)

LISTEN_BACKLOG = 2048
"""Accept queue of a worker's ``SO_REUSEPORT`` socket (uvicorn's default backlog)."""

METRICS_READ_TIMEOUT_S = 10.0
"""How long a worker's own metrics listener waits for a request's headers."""

PARENT_POLL_S = 1.0
"""How often a worker checks that its supervisor is alive."""


def run(
    settings: RouterSettings,
    *,
    ready: Callable[[dict[str, Any]], None] | None = None,
    parent_pid: int | None = None,
) -> None:
    """:func:`serve` on a uvloop event loop (the process entry point of a router and of each
    worker). uvloop's transports, timers and selector are C: on the router's request path they
    cost less than half of asyncio's (measured, docs/router.md "CPU per request"); grpc.aio
    registers its completion-queue socket with whatever loop runs."""
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(settings, ready=ready, parent_pid=parent_pid))


def create_app(
    settings: RouterSettings,
    *,
    runtime: RouterRuntime | None = None,
    connectors: ConnectorFactory | None = None,
) -> FastAPI:
    """The router app: vLLM's OpenAI front end (``services.router.frontend.vllm``) for
    ``settings.tokenizer`` over pdserve's executor. With ``runtime``, nothing connects to Redis
    (the caller feeds the pool); otherwise the lifespan builds one with ``connectors`` (gRPC by
    default)."""

    @contextlib.asynccontextmanager
    async def runtime_context() -> AsyncIterator[RouterRuntime]:
        if runtime is not None:  # prepared by the caller: nothing to build or close
            yield runtime
            return
        registry = CollectorRegistry()
        metrics = RouterMetrics(registry)
        factory = connectors or GrpcConnectorFactory(
            settings.engine_grpc.client_tls(),
            client=settings.engine_grpc.client,
            on_protocol_error=metrics.engine_protocol_error,
            on_retry=metrics.engine_call_retry,
        )
        metrics.engine_grpc_client.labels(client=settings.engine_grpc.client).set(1)
        built = RouterRuntime.build(settings, factory, metrics)
        control_plane = RedisControlPlane(settings.control_plane, ControlPlaneMetrics(registry))
        follower = asyncio.create_task(built.pool.follow(control_plane), name="pdserve-router-pool")
        try:
            yield built
        finally:
            follower.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await follower
            await built.executor.close()
            await built.close()
            await built.pool.close()
            await control_plane.close()

    return _vllm_app(settings, runtime_context)


def _vllm_app(
    settings: RouterSettings,
    runtime_context: Callable[[], contextlib.AbstractAsyncContextManager[RouterRuntime]],
) -> FastAPI:
    """vLLM's front end (``services.router.frontend.vllm``), one per served model."""
    served = vllm_frontend_args(settings)
    from services.router.frontend.vllm.app import create_vllm_app  # noqa: PLC0415
    from services.router.frontend.vllm.config import build_frontend  # noqa: PLC0415

    return create_vllm_app([build_frontend(args) for args in served], runtime_context, ops)


def vllm_frontend_args(settings: RouterSettings) -> list[argparse.Namespace]:
    """vLLM's server flags of each served model's front end, ``settings.served_models()``'s
    order (``SystemExit`` with vLLM's usage message on a flag vLLM or the router refuses;
    ``VllmVersionMismatch`` on another vLLM)."""
    # before the front end's modules import vLLM's
    check_vllm(FRONTEND_SYMBOLS, FRONTEND_INSTANCE_ATTRIBUTES)
    from services.router.frontend.vllm.config import frontend_args  # noqa: PLC0415

    served = []
    for model in settings.served_models():
        flags = [*settings.frontend_args, *model.frontend_args]
        args = frontend_args(model.tokenizer, model.name, flags)
        if settings.api_keys:
            args.api_key = [key.get_secret_value() for key in settings.api_keys]
        served.append(args)
    return served


def uvicorn_config(app: FastAPI, settings: RouterSettings) -> uvicorn.Config:
    """How uvicorn serves the router's ``app`` on ``settings.host``:``settings.port``."""
    return uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        access_log=False,
        proxy_headers=False,  # nothing reads the client address or scheme: one ASGI layer less
        lifespan="on",
        timeout_graceful_shutdown=10,
        timeout_keep_alive=settings.http_keep_alive_s,  # type: ignore[arg-type]  # a float works
        http=CoalescingHttpToolsProtocol,
    )


def reuse_port_socket(host: str, port: int, *, listen: bool = True) -> socket.socket:
    """A TCP socket on ``host:port`` with ``SO_REUSEPORT``, listening unless ``listen`` is
    false: several processes bind the same port and the kernel spreads new connections over
    the listening ones' accept queues (no thundering herd: each connection wakes one
    process)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        if listen:
            sock.listen(LISTEN_BACKLOG)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


async def serve_metrics(registry: CollectorRegistry, host: str, port: int) -> asyncio.Server:
    """A minimal HTTP/1.0-style listener answering ``GET /metrics`` from ``registry`` on the
    event loop (one request per connection; any other path is 404): a worker's own series
    when several workers share the API port."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), METRICS_READ_TIMEOUT_S)
            parts = head.split(b" ", 2)
            if len(parts) > 1 and parts[1].split(b"?")[0] == b"/metrics":
                status, body = b"200 OK", generate_latest(registry)
                kind = CONTENT_TYPE_LATEST.encode()
            else:
                status, body, kind = b"404 Not Found", b"not found\n", b"text/plain"
            writer.write(
                b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%s" % (status, kind, len(body), body)
            )
            await writer.drain()
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass
        finally:
            writer.close()

    return await asyncio.start_server(handle, host, port)


async def serve(
    settings: RouterSettings,
    *,
    connectors: ConnectorFactory | None = None,
    ready: Callable[[dict[str, Any]], None] | None = None,
    parent_pid: int | None = None,
) -> None:
    """Serve until SIGINT/SIGTERM (uvicorn's graceful shutdown). ``ready`` receives the
    ``PDSERVE_READY`` payload instead of stdout; with ``parent_pid`` the router also stops
    when that process is gone (a worker whose supervisor was killed)."""
    app = create_app(settings, connectors=connectors)
    server = uvicorn.Server(uvicorn_config(app, settings))
    sockets = [reuse_port_socket(settings.host, settings.port)] if settings.reuse_port else None
    task = asyncio.create_task(server.serve(sockets=sockets))
    while not server.started:
        if task.done():
            await task
            return
        await asyncio.sleep(0.02)
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    metrics_server: asyncio.Server | None = None
    watch: asyncio.Task[None] | None = None
    try:
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://{host}:{port}"
        payload: dict[str, Any] = {
            "service": "router",
            "url": url,
            "port": port,
            "metrics_url": f"{url}/metrics",
            "pid": os.getpid(),
        }
        if settings.metrics_port is not None:
            runtime: RouterRuntime = app.state.runtime
            metrics_server = await serve_metrics(
                runtime.metrics.registry, settings.host, settings.metrics_port
            )
            metrics_port = metrics_server.sockets[0].getsockname()[1]
            payload["metrics_url"] = f"http://{host}:{metrics_port}/metrics"
        if parent_pid is not None:
            watch = asyncio.create_task(_exit_without(parent_pid, server))
        freeze_startup_heap()
        if ready is not None:
            ready(payload)
        else:
            print(format_ready_line(payload), flush=True)
        await task
    finally:
        if watch is not None:
            watch.cancel()
        if metrics_server is not None:
            metrics_server.close()
        server.should_exit = True
        await task


async def _exit_without(parent_pid: int, server: uvicorn.Server) -> None:
    """Stop ``server`` (gracefully) once ``parent_pid`` is no longer this process's parent."""
    while os.getppid() == parent_pid:  # noqa: ASYNC110 - no event says a parent died
        await asyncio.sleep(PARENT_POLL_S)
    logger.warning("router supervisor %d is gone; this worker stops", parent_pid)
    server.should_exit = True
