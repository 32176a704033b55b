"""The router app: vLLM's own OpenAI front end over pdserve's executor.

vLLM's ``build_app`` and ``init_app_state`` build the app vLLM's server serves (every route,
its middleware, its exception handlers), over :class:`~.engine_client.PdserveEngineClient`
instead of ``AsyncLLM``. pdserve keeps its own ``/health`` (a READY engine pair, not a local
engine) and ``/metrics`` (the router's registry), and adds :class:`PdserveHeaders`. Each
served base model has its own vLLM state, chosen per request (:mod:`.model_states`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import FastAPI
from starlette.datastructures import State
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.app import build_app

from services.router.errors import CLIENT_DISCONNECTED, RequestTooLarge, outcome_of_status
from services.router.execution.generation import RunInfo
from services.router.frontend.vllm import request_guard
from services.router.frontend.vllm.config import Frontend
from services.router.frontend.vllm.engine_client import (
    REQUEST_RUNS,
    HttpRequestRuns,
    PdserveEngineClient,
)
from services.router.frontend.vllm.ignored_fields import count_ignored_fields
from services.router.frontend.vllm.lora import adopt
from services.router.frontend.vllm.model_states import (
    MODEL_SCOPE_KEY,
    ModelDispatch,
    ModelStates,
    models_router,
)
from services.router.runtime import RouterRuntime

logger = logging.getLogger(__name__)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

GENERATION_ENDPOINTS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
"""Paths whose answers carry the ``x-pdserve-*`` headers (the path is the ``endpoint`` label)."""

PDSERVE_ROUTES = frozenset({"/health", "/metrics", "/v1/models"})
"""vLLM's routes that pdserve answers itself (``services.router.frontend.ops``; ``/v1/models``
over every served model: :mod:`.model_states`)."""

SUPPORTED_TASKS = ("generate",)


def create_vllm_app(
    frontends: list[Frontend],
    build_runtime: Callable[[], contextlib.AbstractAsyncContextManager[RouterRuntime]],
    ops_router: Any,
) -> FastAPI:
    """vLLM's app for ``frontends`` (one per served base model, the first answering what
    names none); ``build_runtime`` enters the router's runtime (pool, executor, control
    plane) for the app's lifetime; ``ops_router`` serves pdserve's ``/health`` and
    ``/metrics``."""
    args = frontends[0].args
    root = logging.getLogger()
    level = root.level
    app: FastAPI = build_app(args, SUPPORTED_TASKS, frontends[0].vllm_config.model_config)
    count_ignored_fields()
    # Importing vLLM's SageMaker routes (model_hosting_container_standards) sets the root
    # logger to ERROR, which would silence every pdserve warning (failover, migration...).
    root.setLevel(level)
    app.router.routes[:] = [
        route for route in app.router.routes if getattr(route, "path", None) not in PDSERVE_ROUTES
    ]
    app.include_router(ops_router)
    app.include_router(models_router)
    states = ModelStates(app.state)
    app.state = states

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with build_runtime() as runtime:
            states.runtime = runtime
            for frontend in frontends:
                state = State()
                client = PdserveEngineClient(frontend, runtime, states.served_names)
                await init_app_state(client, state, frontend.args, SUPPORTED_TASKS)
                adopt(state.openai_serving_models, client.loras)
                states.add(frontend.served_model_name, state)
            states.name_every_model()
            try:
                yield
            finally:
                states.clear()

    app.router.lifespan_context = lifespan
    # vLLM's build_app already built the middleware stack (``add_middleware`` refuses now):
    # PdserveHeaders goes outside it.
    if app.middleware_stack is None:
        app.middleware_stack = app.build_middleware_stack()
    app.middleware_stack = PdserveHeaders(ModelDispatch(app.middleware_stack, states))
    return app


class PdserveHeaders:
    """ASGI middleware of the generation endpoints. It holds the response start (and the
    events sent before the run has engines, such as the Responses API's
    ``response.created``) until the run has its engines or the response ends, so that it
    carries ``x-pdserve-prefill-engine``, ``x-pdserve-decode-engine``,
    ``x-pdserve-execution-path`` and ``x-pdserve-migrations`` of the run (the first
    choice's); a stream whose first event is an error (no engine, every prefill failed:
    nothing was generated) is answered as that error with its status, as a non-streamed
    request is; it counts the request and its latency in the router's metrics, under the
    outcome the router's errors name (:func:`_outcome`). Every POST's body is bounded by
    ``max_request_body_bytes`` (413), and a generation body vLLM would fail on instead of
    refusing is refused (400; :mod:`.request_guard`)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        app = self.app
        runtime: RouterRuntime | None = getattr(
            getattr(scope.get("app"), "state", None), "runtime", None
        )
        if scope["type"] == "http" and scope.get("method") == "POST" and runtime is not None:
            app = _bounded_body(_guarded_body(app), runtime.settings.max_request_body_bytes)
        endpoint = scope.get("path", "") if scope["type"] == "http" else ""
        if endpoint not in GENERATION_ENDPOINTS or scope.get("method") != "POST":
            await app(scope, receive, send)
            return
        arrival_s = time.perf_counter()
        runs = HttpRequestRuns(metrics=runtime.metrics if runtime is not None else None)
        infos = runs.infos
        token = REQUEST_RUNS.set(runs)
        held: Message | None = None
        pending: list[Message] = []
        replaced = False
        status = 500
        error_status: int | None = None  # of an error event in a 200 stream
        ended = False  # the app sent its answer's last part
        disconnected = False  # the client hung up before that

        async def watched_receive() -> Message:
            nonlocal disconnected
            message = await receive()
            if message["type"] == "http.disconnect" and not ended:
                disconnected = True
            return message

        async def send_held(message: Message) -> None:
            nonlocal held, replaced, status, error_status, ended
            if message["type"] == "http.response.body":
                ended = ended or not message.get("more_body", False)
                event = None if error_status else _error_event(message.get("body", b""))
                error_status = event[0] if event else error_status
            if replaced:
                return  # the rest of a stream answered as its first event's error
            if message["type"] == "http.response.start":
                held = message
                status = message["status"]
                return
            if held is None:
                await send(_with_migrations(message, infos))
                return
            pending.append(message)
            started = bool(infos) and infos[0].path is not None
            if not started and message.get("more_body", False):
                return  # events before the run has engines (Responses' "created"): held
            start, held = held, None
            error = _leading_error(start, pending[0].get("body", b""))
            if error is not None:
                replaced = True
                status = error[0]
                await send(_start(status, [(b"content-type", b"application/json")], infos))
                await send({"type": "http.response.body", "body": error[1]})
                return
            await send(_start(start["status"], list(start.get("headers", [])), infos))
            for part in pending:
                await send(_with_migrations(part, infos))
            pending.clear()

        try:
            await app(scope, watched_receive, send_held)
        finally:
            REQUEST_RUNS.reset(token)
            if runtime is not None:
                outcome = _outcome(runs, status, error_status, disconnected=disconnected)
                tokens = _tokens(infos)
                runtime.executor.observe_end(
                    arrival_s, endpoint, outcome, infos[0] if infos else None, tokens
                )
                model = scope.get(MODEL_SCOPE_KEY)
                if model is not None:  # (the app's lifespan had built the models' states)
                    elapsed_s = time.perf_counter() - arrival_s
                    runtime.metrics.observe_model(model, outcome, elapsed_s, tokens)


def _outcome(
    runs: HttpRequestRuns, status: int, error_status: int | None, *, disconnected: bool
) -> str:
    """The ``outcome`` of ``pdserve_router_requests_total`` for an answer:
    ``client_disconnected`` when the client hung up before the answer
    ended; else the code of the router error it was answered with (before the answer or
    mid-stream); else by its HTTP status, or by the status of an error event in a 200 stream
    (an error of vLLM's own code)."""
    if disconnected:
        return CLIENT_DISCONNECTED
    if runs.error_code is not None:
        return runs.error_code
    if status < 400 and error_status is not None:
        return outcome_of_status(error_status)
    return outcome_of_status(status)


def _with_migrations(message: Message, infos: list[RunInfo]) -> Message:
    """``message`` with ``usage.pdserve_migrations`` when it is a stream's usage event and
    the runs migrated (a migration after the response started is in no header)."""
    migrations = sum(info.migrations for info in infos)
    body = message.get("body", b"")
    if not migrations or not body.startswith(b"data: {") or b'"usage":{' not in body:
        return message
    event = json.loads(body[len(b"data: ") :].split(b"\n\n", 1)[0])
    if not isinstance(event.get("usage"), dict):
        return message
    event["usage"]["pdserve_migrations"] = migrations
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return {**message, "body": b"data: " + data.encode() + b"\n\n"}


def _tokens(infos: list[RunInfo]) -> tuple[int, int] | None:
    """Every run's prompt and generated tokens, for the router's token metrics (vLLM's front
    end runs a run per choice: a prompt of ``n`` choices counts ``n`` times, as its engines
    were asked for it); ``None`` when no run reached an engine."""
    ran = [info for info in infos if info.path is not None]
    if not ran:
        return None
    return sum(info.prompt_tokens for info in ran), sum(info.completion_tokens for info in ran)


def _bounded_body(
    app: Callable[[Scope, Receive, Send], Awaitable[None]], limit: int
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``app`` with request bodies of at most ``limit`` bytes (pdserve's
    ``max_request_body_bytes``): a larger one is answered 413 in vLLM's
    error shape before the app reads anything when ``Content-Length`` says so, else once the
    bytes read pass it (the app then sees the client leave, and its answer is dropped)."""

    async def bounded(scope: Scope, receive: Receive, send: Send) -> None:
        headers = dict(scope.get("headers", []))
        declared = headers.get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(send, int(declared), limit)
            return
        size = 0
        over = False
        started = False

        async def counted() -> Message:
            nonlocal size, over
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
                if size > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def unless_over(message: Message) -> None:
            nonlocal started
            if over:
                return
            started = True
            await send(message)

        await app(scope, counted, unless_over)
        if over and not started:
            await _too_large(send, size, limit)

    return bounded


def _guarded_body(
    app: Callable[[Scope, Receive, Send], Awaitable[None]],
) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """``app`` behind :func:`request_guard.refusal`: the body of a POST to an endpoint it
    guards is read whole first (then handed to ``app`` as it came), and one it refuses is
    answered 400 in vLLM's error shape before vLLM sees it."""

    async def guarded(scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if path not in request_guard.GUARDED_FIELDS:
            await app(scope, receive, send)
            return
        messages: list[Message] = []
        body = bytearray()
        whole = False
        while not whole:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            whole = not message.get("more_body", False)
        problem = request_guard.refusal(path, bytes(body)) if whole else None
        if problem is not None:
            await _error(send, 400, "BadRequestError", *problem)
            return
        read = iter(messages)

        async def replayed() -> Message:
            return next(read, None) or await receive()

        await app(scope, replayed, send)

    return guarded


async def _too_large(send: Send, size: int, limit: int) -> None:
    await _error(send, 413, "BadRequestError", RequestTooLarge.of_body(size, limit).message)


async def _error(
    send: Send, status: int, error_type: str, message: str, param: str | None = None
) -> None:
    """An answer in vLLM's error shape (``ErrorResponse``)."""
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json")],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _start(status: int, headers: list[tuple[bytes, bytes]], infos: list[RunInfo]) -> Message:
    if infos:
        info = infos[0]
        if info.prefill_engine is not None:
            headers.append((b"x-pdserve-prefill-engine", info.prefill_engine.encode()))
        if info.decode_engine is not None:
            headers.append((b"x-pdserve-decode-engine", info.decode_engine.encode()))
        if info.path is not None:
            headers.append((b"x-pdserve-execution-path", info.path.encode()))
        migrations = sum(i.migrations for i in infos)
        if migrations:
            headers.append((b"x-pdserve-migrations", str(migrations).encode()))
    return {"type": "http.response.start", "status": status, "headers": headers}


def _leading_error(start: Message, body: bytes) -> tuple[int, bytes] | None:
    """``(status, JSON envelope)`` when a 200 event stream opens with vLLM's error event."""
    error = _error_event(body) if start["status"] == 200 else None
    return None if error is None else (error[0], json.dumps(error[1]).encode())


def _error_event(body: bytes) -> tuple[int, dict[str, Any]] | None:
    """``(HTTP status, event)`` when ``body`` (a stream's part) opens with vLLM's error event."""
    if not body.startswith(b'data: {"error"'):
        return None
    try:
        event = json.loads(body[len(b"data: ") :].split(b"\n\n", 1)[0])
        code = int(event["error"]["code"])
    except (ValueError, KeyError, TypeError):
        return None
    return (code, event) if 400 <= code <= 599 else None
