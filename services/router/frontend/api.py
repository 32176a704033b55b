"""The OpenAI-compatible HTTP API: routes, authentication and the request each route builds.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models`` (Bearer
key when configured), ``GET /health`` and ``GET /metrics`` (open: probes and Prometheus). A
generation route turns the body into a
:class:`~services.router.execution.generation.GenerationRequest` (checked against the engines of its
model, with the HTTP request's W3C trace context: :mod:`services.router.frontend.trace_headers`)
and hands it to
:func:`services.router.frontend.responses.serve` (one choice) or
:func:`services.router.frontend.choices.serve_choices` (``n > 1``, echo, logprobs); the response
shapes and headers are described there. Every error is answered with the OpenAI envelope by
the handlers of :mod:`services.router.frontend.error_handlers`.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from services.control_plane.wire import EngineRecord
from services.engines.backend import SamplingParams
from services.engines.errors import InvalidRequest
from services.engines.trace_context import TraceContext
from services.router.errors import (
    AuthenticationError,
    InvalidRequestError,
    NoEngineAvailable,
)
from services.router.execution.generation import GenerationRequest
from services.router.frontend import params, trace_headers
from services.router.frontend.choices import Choice, serve_choices
from services.router.frontend.direct_route import DirectRoute
from services.router.frontend.protocol import (
    REMOVED_GUIDED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    StreamUsage,
    ignored_fields,
    now_s,
)
from services.router.frontend.responses import (
    CHAT,
    COMPLETIONS,
    json_response,
    serve,
    unless_client_leaves,
)
from services.router.runtime import RouterRuntime

logger = logging.getLogger(__name__)

COMPLETIONS_DEFAULT_MAX_TOKENS = 16
"""OpenAI's default ``max_tokens`` for ``/v1/completions``."""


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


@generation.post("/completions")
async def completions(body: CompletionRequest, runtime: Runtime, http: Request) -> Response:
    arrival = time.perf_counter()
    _reject_unsupported(body.unsupported())
    _ignore_unknown(runtime, body)
    context = _context(runtime, body.model)
    prompts = [
        await _prompt_ids(runtime, prompt, body.add_special_tokens, context)
        for prompt in body.prompts()
    ]
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
    trace = trace_headers.from_asgi(http.scope["headers"], runtime.metrics)
    if len(prompts) == 1 and body.n == 1 and not echo and params.plain(sampling):
        request = _generation_request(
            "cmpl", body.model, prompts[0], sampling, arrival, stream, trace
        )
        _check_engines(runtime, request)
        return await serve(runtime, http, COMPLETIONS, request, stream, _stream_usage(body))
    base = f"cmpl-{_random_hex()}"
    choices: list[Choice] = []
    for prompt_index, token_ids in enumerate(prompts):
        echo_text = runtime.tokenizer.decode(token_ids) if echo else ""
        for i in range(body.n):
            request = _generation_request(
                "cmpl", body.model, token_ids, _nth(sampling, i), arrival, stream, trace
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
        _stream_usage(body),
        lambda work: unless_client_leaves(http, work),
    )


@generation.post("/chat/completions")
async def chat_completions(
    body: ChatCompletionRequest, runtime: Runtime, http: Request
) -> Response:
    arrival = time.perf_counter()
    _reject_unsupported(body.unsupported())
    _ignore_unknown(runtime, body)
    token_ids = await runtime.prompts.chat(
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        context=_context(runtime, body.model),
    )
    max_tokens = (
        body.max_completion_tokens or body.max_tokens or runtime.settings.default_max_tokens
    )
    top = (body.top_logprobs or 0) if body.logprobs else None
    sampling = params.sampling_of(
        body, max_tokens, logprobs=top, prompt_logprobs=body.prompt_logprobs
    )
    stream = bool(body.stream)
    trace = trace_headers.from_asgi(http.scope["headers"], runtime.metrics)
    if body.n == 1 and params.plain(sampling):
        request = _generation_request(
            "chatcmpl", body.model, token_ids, sampling, arrival, stream, trace
        )
        _check_engines(runtime, request)
        return await serve(runtime, http, CHAT, request, stream, _stream_usage(body))
    base = f"chatcmpl-{_random_hex()}"
    choices = []
    for i in range(body.n):
        request = _generation_request(
            "chatcmpl", body.model, token_ids, _nth(sampling, i), arrival, stream, trace
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
        _stream_usage(body),
        lambda work: unless_client_leaves(http, work),
    )


async def _prompt_ids(
    runtime: RouterRuntime, prompt: str | list[int], special: bool | None, context: int | None
) -> list[int]:
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        return await runtime.prompts.completion(
            prompt, add_special_tokens=special is not False, context=context
        )
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


def _records(runtime: RouterRuntime, model: str) -> list[EngineRecord]:
    """The records of ``model``'s engines in the pool."""
    return [slot.record for slot in runtime.pool.slots() if slot.record.model == model]


def _context(runtime: RouterRuntime, model: str) -> int | None:
    """The context a prompt of ``model`` must fit (``params.context_limit``)."""
    return params.context_limit(_records(runtime, model))


def _check_engines(runtime: RouterRuntime, request: GenerationRequest) -> None:
    """Parameters every engine of the model can honour; a context that fits one of them."""
    records = _records(runtime, request.model)
    try:
        request.sampling.validate(vocab_size=runtime.tokenizer.vocab_size)
    except InvalidRequest as exc:
        raise InvalidRequestError(str(exc)) from exc
    params.check_engines(records, request.sampling)
    params.check_context(records, len(request.prompt_token_ids), request.sampling.max_tokens)


@v1.get("/models")
async def models(runtime: Runtime) -> dict[str, Any]:
    """The served models, each with ``max_model_len`` as vLLM's server lists it: here the
    smallest context of the model's READY engines (every request that fits it fits wherever
    it is placed); ``None`` while no engine reports one."""
    created = now_s()
    lengths: dict[str, list[int]] = {}
    for slot in runtime.pool.slots():
        if slot.record.max_model_len:
            lengths.setdefault(slot.record.model, []).append(slot.record.max_model_len)
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "pdserve",
                "max_model_len": min(lengths[model]) if model in lengths else None,
            }
            for model in runtime.pool.ready_models()
        ],
    }


@ops.get("/health")
async def health(runtime: Runtime) -> Response:
    """200 when the router can serve (see ``Scheduler.ready``), else 503 with the reason."""
    if runtime.pool.synced and runtime.scheduler.ready():
        return json_response(200, {"status": "ok", "models": runtime.pool.ready_models()})
    reason = (
        "not synced with the control plane yet"
        if not runtime.pool.synced
        else "no READY compatible prefill/decode engine pair and no READY colocated engine"
    )
    return json_response(503, NoEngineAvailable(reason, code="not_ready").envelope())


@ops.get("/metrics")
async def metrics(runtime: Runtime) -> Response:
    return Response(generate_latest(runtime.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _ignore_unknown(
    runtime: RouterRuntime, body: CompletionRequest | ChatCompletionRequest
) -> None:
    """Fields vLLM's server would ignore are ignored: counted, each name logged once."""
    names = ignored_fields(body)
    if not names:
        return
    for name in runtime.metrics.ignored(names):
        if name in REMOVED_GUIDED_FIELDS:
            logger.warning(
                "a request contains the removed guided-decoding field %r, which is ignored "
                "(as vLLM's server does): the output is NOT constrained; use "
                "structured_outputs or response_format",
                name,
            )
        else:
            logger.info("a request contains the field %r, which is ignored (as vLLM's)", name)


def _reject_unsupported(problem: tuple[str, str] | None) -> None:
    if problem is not None:
        param, message = problem
        raise InvalidRequestError(message, param=param, code="unsupported_parameter")


def _stream_usage(body: CompletionRequest | ChatCompletionRequest) -> StreamUsage:
    return "none" if body.stream_options is None else body.stream_options.usage()


def _random_hex() -> str:
    """128 random bits as 32 hex digits (a request id's tail; ``uuid4().hex`` built a ``UUID``
    object per request for the same digits)."""
    return os.urandom(16).hex()


def _generation_request(
    prefix: str,
    model: str,
    token_ids: list[int],
    sampling: SamplingParams,
    arrival_s: float,
    stream: bool,
    trace: TraceContext | None,
) -> GenerationRequest:
    if not token_ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    return GenerationRequest(
        request_id=f"{prefix}-{_random_hex()}",
        model=model,
        prompt_token_ids=tuple(token_ids),
        sampling=sampling,
        arrival_s=arrival_s,
        stream=stream,
        trace=trace,
    )
