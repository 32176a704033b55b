"""One generation's HTTP response: the JSON body or the SSE stream, its headers, and the
client hang-up before it starts.

:func:`serve` runs a planned :class:`~services.router.execution.generation.GenerationRequest` on the
executor and answers it in an endpoint's :class:`Output` shape (``/v1/completions`` or
``/v1/chat/completions``); :func:`unless_client_leaves` cancels the work of a client that
hangs up first. The routes that build the request are in :mod:`services.router.frontend.api`.

Response headers of a generation: ``x-pdserve-prefill-engine`` (absent when the request ran
locally), ``x-pdserve-decode-engine``, ``x-pdserve-execution-path`` and ``x-request-id``; on a
non-streamed request that moved to another engine pair mid-way
(services.router.execution.migration), ``x-pdserve-migrations``. The usage object of such a request
(the response's, or the streamed ``include_usage`` chunk's) carries ``pdserve_migrations`` too.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic_core
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from services.engines.backend import FinishReason
from services.router.errors import EngineRequestFailed, RouterError
from services.router.execution.generation import Chunk, GenerationRequest, RunInfo
from services.router.frontend.protocol import (
    SSE_DONE,
    StreamUsage,
    finish_text,
    now_s,
    running_usage,
    sse_event,
    usage_body,
)
from services.router.runtime import RouterRuntime

logger = logging.getLogger(__name__)

CLIENT_CLOSED_REQUEST = 499
"""Status recorded for a request whose client hung up before its response started (nginx's
convention); nobody receives it."""

T = TypeVar("T")


@dataclass
class Output:
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


COMPLETIONS = Output(
    "/v1/completions", "text_completion", "text_completion", _completion_choice, _completion_delta
)
CHAT = Output(
    "/v1/chat/completions",
    "chat.completion",
    "chat.completion.chunk",
    _chat_choice,
    _chat_delta,
)


class ClientDisconnected(Exception):
    """The HTTP client closed its connection before its response started."""


async def _client_left(http: Request) -> None:
    """Returns once the client has closed the connection (the body was read already, so the
    server's next message is ``http.disconnect``)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(http: Request, work: Coroutine[Any, Any, T]) -> T:
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


async def serve(
    runtime: RouterRuntime,
    http: Request,
    output: Output,
    request: GenerationRequest,
    stream: bool,
    usage: StreamUsage,
) -> Response:
    """Run the request; errors up to the first token are raised (an HTTP error), later ones
    end the stream with an error event. A client that hangs up before the response starts
    cancels the run (counted ``client_disconnected``); after that, Starlette's own disconnect
    handling ends the stream the same way. ``request`` was checked against the engines of its
    model (``services.router.frontend.api._check_engines``)."""
    info = RunInfo()
    run = runtime.executor.generate(request, info)
    streaming = False
    try:
        if stream:
            first = await unless_client_leaves(http, anext(run))
            streaming = True  # from here on ``_sse`` owns ``run``
        else:
            text, finish = await unless_client_leaves(http, _collect(run))
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
        events = _sse(runtime, output, request, info, run, first, usage)
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
    return json_response(200, body, headers)


_TEXT_MARK = "\x00pdserve-text\x00"
"""Stands for a streamed event's text while its JSON is rendered once per request (``_sse``)."""


async def _sse(
    runtime: RouterRuntime,
    output: Output,
    request: GenerationRequest,
    info: RunInfo,
    run: AsyncGenerator[Chunk, None],
    first: Chunk,
    usage: StreamUsage,
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
        if usage == "continuous":
            body["usage"] = running_usage(info.prompt_tokens, info.completion_tokens)
        elif usage == "final":
            body["usage"] = None
        return sse_event(body)

    # The events between the first and the last differ only in their text: rendered once
    # around a marker, each is then the two halves around its text's JSON string (not with
    # continuous usage, which differs per event too).
    halves = (
        event(_TEXT_MARK, None, False).split(json.dumps(_TEXT_MARK).encode())
        if usage != "continuous"
        else []
    )

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
        if usage != "none":
            yield sse_event(
                {
                    "id": request.request_id,
                    "object": output.chunk_object_name,
                    "created": created,
                    "model": request.model,
                    "choices": [],
                    "usage": _usage(info),
                }
            )
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


def json_response(status: int, body: Any, headers: dict[str, str] | None = None) -> Response:
    """``body`` as compact UTF-8 JSON (pydantic-core's encoder, as vLLM's server answers:
    a non-finite float is ``null``, never the invalid ``NaN``)."""
    return JSONBytesResponse(pydantic_core.to_json(body), status, headers)


class JSONBytesResponse(Response):
    """A Starlette response of JSON already encoded, with ``headers`` (names in any case)
    followed by ``content-length`` and ``content-type: application/json``: what
    ``Response(body, media_type="application/json", headers=...)`` sends, its header list built
    directly (Starlette's scans it for the two names and looks up the media type's charset; on
    every request's path)."""

    media_type = "application/json"

    def __init__(self, body: bytes, status_code: int, headers: dict[str, str] | None) -> None:
        self.status_code = status_code
        self.background = None
        self.body = body
        raw = (
            [
                (name.lower().encode("latin-1"), value.encode("latin-1"))
                for name, value in headers.items()
            ]
            if headers
            else []
        )
        raw.append((b"content-length", str(len(body)).encode()))
        raw.append((b"content-type", b"application/json"))
        self.raw_headers = raw
