"""The OpenAI-compatible HTTP API: routes, authentication and the one error envelope.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (Bearer
key when configured), ``GET /health`` and ``GET /metrics`` (open: probes and Prometheus).
Every error, including FastAPI's validation errors and Starlette's 404/405, is answered with
``{"error": {"message", "type", "param", "code"}}`` by the handlers in
:func:`install_error_handlers`.

Response headers of a generation: ``x-pdserve-prefill-engine`` (absent when the request ran
locally), ``x-pdserve-decode-engine``, ``x-pdserve-execution-path`` and ``x-request-id``; on a
non-streamed request that moved to another engine pair mid-way (services.router.migration),
``x-pdserve-migrations``. The usage object of such a request (the response's, or the streamed
``include_usage`` chunk's) carries ``pdserve_migrations`` too.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.engines.backend import FinishReason, SamplingParams
from services.engines.errors import InvalidRequest, TokenizerError
from services.router import params
from services.router.choices import Choice, serve_choices
from services.router.direct_route import DirectRoute
from services.router.errors import (
    AuthenticationError,
    EngineRequestFailed,
    InvalidRequestError,
    NoEngineAvailable,
    RouterError,
)
from services.router.execution import Chunk, GenerationRequest, RunInfo
from services.router.protocol import (
    SSE_DONE,
    ChatCompletionRequest,
    CompletionRequest,
    finish_text,
    now_s,
    sse_event,
    usage_body,
)
from services.router.runtime import RouterRuntime

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""

CLIENT_CLOSED_REQUEST = 499
"""Status recorded for a request whose client hung up before its response started (nginx's
convention); nobody receives it."""

T = TypeVar("T")


# The dependencies are ``async def`` on purpose: FastAPI runs a plain ``def`` dependency in its
# thread pool, two thread hand-offs per request for what is an attribute read and a compare.


async def get_runtime(request: Request) -> RouterRuntime:
    runtime: RouterRuntime = request.app.state.runtime
    return runtime


Runtime = Annotated[RouterRuntime, Depends(get_runtime)]


async def require_api_key(request: Request, runtime: Runtime) -> None:
    """Check ``Authorization: Bearer <key>`` against the configured keys in constant time
    (every key is compared, whatever matches); no keys configured = open."""
    keys = runtime.api_keys
    if not keys:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise AuthenticationError(
            "missing API key: send 'Authorization: Bearer <key>'", code="missing_api_key"
        )
    provided = token.strip().encode()
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(provided, key)
    if not matched:
        raise AuthenticationError("invalid API key")


class _GenerationRoute(DirectRoute):
    key_check = require_api_key


v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
generation = APIRouter(prefix="/v1", route_class=_GenerationRoute)
"""The two generation endpoints: :class:`DirectRoute` runs the key check and the body
validation itself (no per-request dependency solving); their signatures document them."""
ops = APIRouter()


@dataclass
class _Output:
    """Shape of one endpoint's response bodies."""

    endpoint: str
    object_name: str
    chunk_object_name: str
    render_choice: Callable[[str, str | None], dict[str, Any]]
    render_delta: Callable[[str, str | None, bool], dict[str, Any]]


def _completion_choice(text: str, finish: str | None) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _completion_delta(text: str, finish: str | None, first: bool) -> dict[str, Any]:
    return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}


def _chat_choice(text: str, finish: str | None) -> dict[str, Any]:
    return {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": finish,
    }


def _chat_delta(text: str, finish: str | None, first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"content": text}
    if first:
        delta["role"] = "assistant"
    return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}


COMPLETIONS = _Output(
    "/v1/completions", "text_completion", "text_completion", _completion_choice, _completion_delta
)
CHAT = _Output(
    "/v1/chat/completions",
    "chat.completion",
    "chat.completion.chunk",
    _chat_choice,
    _chat_delta,
)


@generation.post("/completions")
async def completions(body: CompletionRequest, runtime: Runtime, http: Request) -> Response:
    arrival = time.perf_counter()
    _reject_unsupported(body.unsupported())
    prompts = [_prompt_ids(runtime, prompt, body.add_special_tokens) for prompt in body.prompts()]
    max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    echo = bool(body.echo)
    if max_tokens == 0 and not echo:  # vLLM's rule: 0 only scores an echoed prompt
        raise InvalidRequestError("max_tokens must be at least 1, got 0.", param="max_tokens")
    prompt_logprobs = body.prompt_logprobs
    if prompt_logprobs is None and echo:
        prompt_logprobs = body.logprobs
    sampling = params.sampling_of(
        body, max(max_tokens, 1), logprobs=body.logprobs, prompt_logprobs=prompt_logprobs
    )
    stream = bool(body.stream)
    if len(prompts) == 1 and body.n == 1 and not echo and params.plain(sampling):
        request = _generation_request("cmpl", body.model, prompts[0], sampling, arrival, stream)
        _check_engines(runtime, request)
        return await _serve(runtime, http, COMPLETIONS, request, stream, _include_usage(body))
    base = f"cmpl-{uuid.uuid4().hex}"
    choices: list[Choice] = []
    for prompt_index, token_ids in enumerate(prompts):
        echo_text = runtime.tokenizer.decode(token_ids) if echo else ""
        for i in range(body.n):
            request = _generation_request(
                "cmpl", body.model, token_ids, _nth(sampling, i), arrival, stream
            )
            request = dataclasses.replace(request, request_id=f"{base}-{len(choices)}")
            _check_engines(runtime, request)
            choices.append(
                Choice(
                    len(choices),
                    prompt_index,
                    request,
                    echo_text=echo_text,
                    echo_only=echo and max_tokens == 0,
                    logprobs=body.logprobs,
                )
            )
    return await serve_choices(
        runtime,
        "completion",
        COMPLETIONS.endpoint,
        choices,
        stream,
        _include_usage(body),
        lambda work: _unless_client_leaves(http, work),
    )


@generation.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, runtime: Runtime, http: Request
) -> Response:
    arrival = time.perf_counter()
    _reject_unsupported(body.unsupported())
    token_ids = runtime.chat.tokenize(
        body.messages, add_generation_prompt=body.add_generation_prompt
    )
    max_tokens = (
        body.max_completion_tokens or body.max_tokens or runtime.settings.default_max_tokens
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    sampling = params.sampling_of(
        body, max_tokens, logprobs=top, prompt_logprobs=body.prompt_logprobs
    )
    stream = bool(body.stream)
    if body.n == 1 and params.plain(sampling):
        request = _generation_request("chatcmpl", body.model, token_ids, sampling, arrival, stream)
        _check_engines(runtime, request)
        return await _serve(runtime, http, CHAT, request, stream, _include_usage(body))
    base = f"chatcmpl-{uuid.uuid4().hex}"
    choices = []
    for i in range(body.n):
        request = _generation_request(
            "chatcmpl", body.model, token_ids, _nth(sampling, i), arrival, stream
        )
        request = dataclasses.replace(request, request_id=f"{base}-{i}")
        _check_engines(runtime, request)
        choices.append(Choice(i, 0, request, logprobs=top))
    return await serve_choices(
        runtime,
        "chat",
        CHAT.endpoint,
        choices,
        stream,
        _include_usage(body),
        lambda work: _unless_client_leaves(http, work),
    )


def _prompt_ids(runtime: RouterRuntime, prompt: str | list[int], special: bool | None) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return runtime.tokenizer.encode(prompt, add_special_tokens=special is not False)
    vocab = runtime.tokenizer.vocab_size
    if any(token >= vocab for token in prompt):
        raise InvalidRequestError(
            f"prompt token ids must be below the vocabulary size {vocab}", param="prompt"
        )
    return prompt


def _nth(sampling: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s parameters: with a seed, ``seed + index`` (vLLM's rule)."""
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=(sampling.seed + index) & params.SEED_MASK)


def _check_engines(runtime: RouterRuntime, request: GenerationRequest) -> None:
    """Parameters every engine of the model can honour; a context that fits one of them."""
    records = [slot.record for slot in runtime.pool.slots() if slot.record.model == request.model]
    try:
        request.sampling.validate(vocab_size=runtime.tokenizer.vocab_size)
    except InvalidRequest as exc:
        raise InvalidRequestError(str(exc)) from exc
    params.check_engines(records, request.sampling)
    params.check_context(records, len(request.prompt_token_ids), request.sampling.max_tokens)


@v1.get("/models")
async def models(runtime: Runtime) -> dict[str, Any]:
    created = now_s()
    return {
        "object": "list",
        "data": [
            {"id": model, "object": "model", "created": created, "owned_by": "pdserve"}
            for model in runtime.pool.ready_models()
        ],
    }


@ops.get("/health")
async def health(runtime: Runtime) -> Response:
    """200 when the router can serve (see ``Scheduler.ready``), else 503 with the reason."""
    if runtime.pool.synced and runtime.scheduler.ready():
        return _json(200, {"status": "ok", "models": runtime.pool.ready_models()})
    reason = (
        "not synced with the control plane yet"
        if not runtime.pool.synced
        else "no READY compatible prefill/decode engine pair and no READY colocated engine"
    )
    return _json(503, NoEngineAvailable(reason, code="not_ready").envelope())


@ops.get("/metrics")
async def metrics(runtime: Runtime) -> Response:
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _reject_unsupported(problem: tuple[str, str] | None) -> None:
    if problem is not None:
        param, message = problem
        raise InvalidRequestError(message, param=param, code="unsupported_parameter")


def _include_usage(body: CompletionRequest | ChatCompletionRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


def _generation_request(
    prefix: str,
    model: str,
    token_ids: list[int],
    sampling: SamplingParams,
    arrival_s: float,
    stream: bool,
) -> GenerationRequest:
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return GenerationRequest(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        model=model,
        prompt_token_ids=tuple(token_ids),
        sampling=sampling,
        arrival_s=arrival_s,
        stream=stream,
    )


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before its response started."""


async def _client_left(http: Request) -> None:
    """Returns once the client has closed the connection (the body was read already, so the
    server's next message is ``http.disconnect``)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _unless_client_leaves(http: Request, work: Coroutine[Any, Any, T]) -> T:
    """``work``'s result; :class:`ClientDisconnected` when the client hangs up first.

    Until its response starts a request is only an awaited coroutine, and Starlette notices a
    disconnect only while it streams: without this a client that gives up during a long prefill
    (or on a non-streaming request) would keep both engines busy to the end. Here the request's
    own task is cancelled instead, which cancels the engine calls ``work`` awaits; each engine
    aborts the request and frees its blocks. ``work`` runs in this task (one extra task per
    request, the watcher, not two: this is on every request's path)."""
    task = asyncio.current_task()
    assert task is not None
    watching = True
    left = False

    def hang_up(watcher: asyncio.Task[None]) -> None:
        nonlocal left
        # ``watching``: the callback may run after ``work`` ended (it is scheduled, not called).
        if watching and not watcher.cancelled() and watcher.exception() is None:
            left = True
            task.cancel()

    watcher = asyncio.ensure_future(_client_left(http))
    watcher.add_done_callback(hang_up)
    try:
        result = await work
    except BaseException:
        if left:  # whatever ``work`` made of the cancellation, the client is gone
            task.uncancel()
            raise ClientDisconnected from None
        raise
    finally:
        watching = False
        watcher.cancel()
    if left:  # ``work`` swallowed the cancellation
        task.uncancel()
        raise ClientDisconnected
    return result


async def _collect(run: AsyncGenerator[Chunk, None]) -> tuple[str, FinishReason]:
    """The whole text of a non-streaming request and why it finished."""
    texts: list[str] = []
    finish: FinishReason | None = None
    try:
        while finish is None:
            chunk = await anext(run)
            texts.append(chunk.text)
            finish = chunk.finish_reason
    except StopAsyncIteration:  # pragma: no cover - the executor ends on a finish reason
        finish = FinishReason.STOP
    return "".join(texts), finish


async def _serve(
    runtime: RouterRuntime,
    http: Request,
    output: _Output,
    request: GenerationRequest,
    stream: bool,
    include_usage: bool,
) -> Response:
    """Run the request; errors up to the first token are raised (an HTTP error), later ones
    end the stream with an error event. A client that hangs up before the response starts
    cancels the run (counted ``client_disconnected``); after that, Starlette's own disconnect
    handling ends the stream the same way. ``request`` passed :func:`_check_engines`."""
    info = RunInfo()
    run = runtime.executor.generate(request, info)
    streaming = False
    try:
        if stream:
            first = await _unless_client_leaves(http, anext(run))
            streaming = True  # from here on ``_sse`` owns ``run``
        else:
            text, finish = await _unless_client_leaves(http, _collect(run))
    except StopAsyncIteration:  # pragma: no cover - generate always yields or raises
        raise EngineRequestFailed("the request produced no output") from None
    except ClientDisconnected:
        logger.info("request %s: the client left before the response started", request.request_id)
        runtime.executor.observe_end(
            request.arrival_s, output.endpoint, "client_disconnected", info
        )
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except RouterError:
        # Counted by the error handler (on_router_error); only the latency is recorded here.
        runtime.executor.observe_latency(request.arrival_s, output.endpoint, info)
        raise
    finally:
        if not streaming:
            await run.aclose()
    headers = _headers(request, info)
    if stream:
        events = _sse(runtime, output, request, info, run, first, include_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    body = {
        "id": request.request_id,
        "object": output.object_name,
        "created": now_s(),
        "model": request.model,
        "choices": [output.render_choice(text, finish_text(finish))],
        "usage": _usage(info),
    }
    runtime.executor.observe_end(request.arrival_s, output.endpoint, "ok", info)
    return _json(200, body, headers)


_TEXT_MARK = "\x00pdserve-text\x00"
"""Stands for a streamed event's text while its JSON is rendered once per request (``_sse``)."""


async def _sse(
    runtime: RouterRuntime,
    output: _Output,
    request: GenerationRequest,
    info: RunInfo,
    run: AsyncGenerator[Chunk, None],
    first: Chunk,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    created = now_s()
    outcome = "client_disconnected"

    def event(text: str, finish: FinishReason | None, is_first: bool) -> bytes:
        body: dict[str, Any] = {
            "id": request.request_id,
            "object": output.chunk_object_name,
            "created": created,
            "model": request.model,
            "choices": [output.render_delta(text, finish_text(finish), is_first)],
        }
        if include_usage:
            body["usage"] = None
        return sse_event(body)

    # The events between the first and the last differ only in their text: rendered once
    # around a marker, each is then the two halves around its text's JSON string.
    halves = event(_TEXT_MARK, None, False).split(json.dumps(_TEXT_MARK).encode())

    try:
        yield event(first.text, first.finish_reason, True)
        finish = first.finish_reason
        while finish is None:
            chunk = await anext(run)
            finish = chunk.finish_reason
            if finish is None:
                if chunk.text and len(halves) == 2:  # (a model name holding the marker: not)
                    yield halves[0] + json.dumps(chunk.text).encode() + halves[1]
                elif chunk.text:
                    yield event(chunk.text, None, False)
            else:
                yield event(chunk.text, finish, False)
        if include_usage:
            usage = {
                "id": request.request_id,
                "object": output.chunk_object_name,
                "created": created,
                "model": request.model,
                "choices": [],
                "usage": _usage(info),
            }
            yield sse_event(usage)
        yield SSE_DONE
        outcome = "ok"
    except StopAsyncIteration:  # pragma: no cover - the executor ends on a finish reason
        outcome = "decode_truncated"
        yield _error_event(EngineRequestFailed("stream ended early", code=outcome))
    except RouterError as exc:
        outcome = exc.code
        logger.warning("request %s failed mid-stream: %s", request.request_id, exc.message)
        yield _error_event(exc)
        yield SSE_DONE
    finally:
        await run.aclose()
        runtime.executor.observe_end(request.arrival_s, output.endpoint, outcome, info)


def _usage(info: RunInfo) -> dict[str, Any]:
    usage = usage_body(info.prompt_tokens, info.completion_tokens, info.cached_tokens)
    if info.migrations:
        usage["pdserve_migrations"] = info.migrations
    return usage


def _error_event(error: RouterError) -> bytes:
    return sse_event(error.envelope())


def _headers(request: GenerationRequest, info: RunInfo) -> dict[str, str]:
    headers = {"x-request-id": request.request_id}
    if info.prefill_engine is not None:
        headers["x-pdserve-prefill-engine"] = info.prefill_engine
    if info.decode_engine is not None:
        headers["x-pdserve-decode-engine"] = info.decode_engine
    if info.path is not None:
        headers["x-pdserve-execution-path"] = info.path
    if info.migrations:
        headers["x-pdserve-migrations"] = str(info.migrations)
    return headers


def _json(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(body, separators=(",", ":")),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


# -- errors --------------------------------------------------------------------------------------


def install_error_handlers(app: FastAPI) -> None:
    """Every error as the OpenAI envelope; request errors counted per endpoint and code."""

    def count(request: Request, code: str) -> None:
        path = request.url.path
        if path.startswith("/v1/"):
            runtime: RouterRuntime | None = getattr(request.app.state, "runtime", None)
            if runtime is not None:
                runtime.metrics.requests.labels(endpoint=path, outcome=code).inc()

    async def on_router_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RouterError)
        count(request, exc.code)
        headers = {"www-authenticate": "Bearer"} if exc.status_code == 401 else None
        return _json(exc.status_code, exc.envelope(), headers)

    async def on_validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        error = validation_error(exc)
        count(request, error.code)
        return _json(error.status_code, error.envelope())

    async def on_http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        codes = {404: "not_found", 405: "method_not_allowed"}
        error = RouterError(str(exc.detail), code=codes.get(exc.status_code, "http_error"))
        error.error_type = "invalid_request_error" if exc.status_code < 500 else "api_error"
        count(request, error.code)
        return _json(exc.status_code, error.envelope(), dict(exc.headers or {}))

    async def on_tokenizer_error(request: Request, exc: Exception) -> Response:
        error = InvalidRequestError(str(exc), param="prompt")
        count(request, error.code)
        return _json(400, error.envelope())

    async def on_unexpected(request: Request, exc: Exception) -> Response:
        logger.exception("unexpected error serving %s", request.url.path, exc_info=exc)
        count(request, "internal_error")
        return _json(500, RouterError("internal error").envelope())

    app.add_exception_handler(RouterError, on_router_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(TokenizerError, on_tokenizer_error)
    app.add_exception_handler(Exception, on_unexpected)


def validation_error(exc: RequestValidationError) -> InvalidRequestError:
    """FastAPI's 422 as OpenAI's 400: the first problem, its field as ``param``."""
    errors = exc.errors()
    if not errors:
        return InvalidRequestError("invalid request body")
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    kind = first.get("type", "")
    if kind == "extra_forbidden":
        return InvalidRequestError(
            f"unsupported parameter {param!r}", param=param, code="unsupported_parameter"
        )
    if kind in ("json_invalid", "model_attributes_type", "model_type", "dict_type"):
        return InvalidRequestError(
            f"the body must be a JSON object: {first.get('msg', '')}", code="invalid_json"
        )
    if kind == "missing":
        return InvalidRequestError(f"missing required parameter {param!r}", param=param)
    return InvalidRequestError(
        f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param
    )
