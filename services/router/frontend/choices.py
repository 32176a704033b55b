"""Requests with several choices (``n > 1``, a batch of prompts), logprobs or ``echo``.

The single-choice request without logprobs keeps the lean path in
:mod:`services.router.frontend.api`; everything else comes here. The ``n`` choices of one prompt
fork from one prefill and one KV transfer when the engine pair can
(:mod:`services.router.execution.fork`); otherwise each choice is its own engine request (its own
prefill and KV transfer), run concurrently. With a ``seed``, choice ``i`` uses ``seed + i`` as vLLM
does, on either path. Choices are numbered prompt-major (``index = prompt * n + i``), as vLLM does.
Usage sums prompt tokens over prompts (once per prompt, not per choice) and completion
tokens over every choice.

The response starts once every choice has its first token, so a failure before that is an
ordinary HTTP error; later failures end the stream with an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi.responses import Response, StreamingResponse

from services.engines.backend import FinishReason, TokenLogprobs
from services.router.errors import EngineRequestFailed, RouterError
from services.router.execution.fork import ChunkStream, forked_runs
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
from services.tokenization.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Kind = Literal["completion", "chat"]
LOGPROB_FLOOR = -9999.0
"""vLLM's floor for a ``-inf`` logprob in chat responses (JSON has no infinity)."""


@dataclass(frozen=True)
class Choice:
    """One choice: its engine request and what its rendering needs."""

    index: int
    prompt_index: int
    request: GenerationRequest
    echo_text: str = ""
    """The prompt's text, prepended to the output (completions' ``echo``)."""
    echo_only: bool = False
    """``echo`` with ``max_tokens=0``: return the prompt, drop the one token generated."""
    logprobs: int | None = None
    """Completions: top logprobs per token; chat: ``top_logprobs`` (with ``logprobs``)."""


@dataclass
class _State:
    choice: Choice
    run: ChunkStream
    info: RunInfo = field(default_factory=RunInfo)
    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()
    finish: FinishReason | None = None
    offset: int = 0


Guard = Callable[[Coroutine[Any, Any, Any]], Awaitable[Any]]


async def serve_choices(
    runtime: RouterRuntime,
    kind: Kind,
    endpoint: str,
    choices: list[Choice],
    stream: bool,
    usage: StreamUsage,
    guard: Guard,
) -> Response:
    """Run every choice; answer as one OpenAI response (or SSE stream)."""
    first_request = choices[0].request
    states: list[_State] = []
    by_prompt: dict[int, list[Choice]] = {}
    for choice in choices:
        by_prompt.setdefault(choice.prompt_index, []).append(choice)
    for group in by_prompt.values():
        infos = [RunInfo() for _ in group]
        runs: list[ChunkStream] | None = forked_runs(
            runtime, [choice.request for choice in group], infos
        )
        if runs is None:
            runs = [
                runtime.executor.generate(choice.request, info)
                for choice, info in zip(group, infos, strict=True)
            ]
        states.extend(map(_State, group, runs, infos))
    states.sort(key=lambda state: state.choice.index)
    streaming = False
    try:
        firsts: list[Chunk] = await guard(_all([anext(s.run) for s in states]))
        if stream:
            streaming = True
            events = _sse(runtime, kind, endpoint, states, firsts, usage)
            return StreamingResponse(
                events,
                media_type="text/event-stream",
                headers={"x-request-id": first_request.request_id},
            )
        await guard(_all([_finish(s, f) for s, f in zip(states, firsts, strict=True)]))
    except RouterError:
        runtime.executor.observe_latency(first_request.arrival_s, endpoint, states[0].info)
        raise
    finally:
        if not streaming:
            for state in states:
                await state.run.aclose()
    tokenizer = runtime.tokenizer
    body = {
        "id": first_request.request_id,
        "object": "text_completion" if kind == "completion" else "chat.completion",
        "created": now_s(),
        "model": first_request.model,
        "choices": [_render(tokenizer, kind, state) for state in states],
        "usage": _usage(states),
    }
    if kind == "chat" and (prompt_logprobs := prompt_logprobs_body(tokenizer, states[0])):
        body["prompt_logprobs"] = prompt_logprobs  # vLLM's chat answer: the request's, once
    runtime.executor.observe_end(
        first_request.arrival_s, endpoint, "ok", states[0].info, _tokens(states)
    )
    return Response(
        json.dumps(body, separators=(",", ":")),
        media_type="application/json",
        headers={"x-request-id": first_request.request_id},
    )


async def _all(work: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Every result; on the first failure the others are cancelled (and awaited) first."""
    tasks = [asyncio.ensure_future(item) for item in work]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _take(state: _State, chunk: Chunk) -> tuple[str, list[TokenLogprobs]]:
    """Record ``chunk``; the text and logprobs it adds to the choice's output."""
    if chunk.prompt_logprobs:
        state.prompt_logprobs = chunk.prompt_logprobs
    state.finish = chunk.finish_reason
    if state.choice.echo_only:
        return "", []
    state.text.append(chunk.text)
    state.logprobs.extend(chunk.logprobs)
    return chunk.text, list(chunk.logprobs)


async def _finish(state: _State, first: Chunk) -> None:
    _take(state, first)
    while state.finish is None:
        _take(state, await anext(state.run))


def _prompts(states: list[_State]) -> list[RunInfo]:
    """One run's info per prompt (its choices share the prompt)."""
    prompts: dict[int, RunInfo] = {}
    for state in states:
        prompts.setdefault(state.choice.prompt_index, state.info)
    return list(prompts.values())


def _usage(states: list[_State]) -> dict[str, Any]:
    prompts = _prompts(states)
    completion = sum(0 if s.choice.echo_only else s.info.completion_tokens for s in states)
    return usage_body(
        sum(info.prompt_tokens for info in prompts),
        completion,
        sum(info.cached_tokens for info in prompts),
    )


def _tokens(states: list[_State]) -> tuple[int, int] | None:
    """The request's prompt tokens (once per prompt) and every choice's generated tokens, for
    the router's token metrics; ``None`` when no run reached an engine."""
    if all(state.info.path is None for state in states):
        return None
    prompt = sum(info.prompt_tokens for info in _prompts(states))
    return prompt, sum(state.info.completion_tokens for state in states)


def prompt_logprobs_body(tokenizer: Tokenizer, state: _State) -> list[Any] | None:
    """vLLM's ``prompt_logprobs`` of a choice: ``None`` for the first prompt token, then per
    token ``{id: {"logprob", "rank", "decoded_token"}}``, the prompt's own token first, then
    the requested most likely ones (ranks 1..k); ``-inf`` clamped to -9999 as vLLM does.
    ``None`` when the request did not ask for them."""
    request = state.choice.request
    top = request.sampling.prompt_logprobs
    if top is None:
        return None
    rendered: list[Any] = [None]
    context: list[int] = []  # the prompt tokens before the position (vLLM's context)
    for entry in state.prompt_logprobs:
        candidates = [(entry.token_id, entry.logprob, entry.rank)]
        candidates += [(i, lp, rank) for rank, (i, lp) in enumerate(entry.top[:top], start=1)]
        position: dict[str, Any] = {}
        for token_id, logprob, rank in candidates:
            position.setdefault(
                str(token_id),
                {
                    "logprob": max(logprob, LOGPROB_FLOOR),
                    "rank": rank,
                    "decoded_token": decoded_token(tokenizer, token_id, context),
                },
            )
        rendered.append(position)
        context.append(entry.token_id)
    return rendered


def decoded_token(tokenizer: Tokenizer, token_id: int, context: list[int]) -> str:
    """A logprob entry's token text as vLLM 0.32 gives it (``v1/engine/logprobs.py``,
    ``LogprobsProcessor._correct_decoded_token``): the token alone, or, when that ends in an
    incomplete UTF-8 character, what it adds after up to 4 tokens of ``context`` (the text it
    completes), else ``""``. A port of those lines while the router does not run vLLM's front
    end (docs/architecture.md, "Router")."""
    alone = tokenizer.decode([token_id], skip_special_tokens=False)
    if not alone.endswith("\ufffd"):
        return alone
    for size in range(1, min(len(context), 4) + 1):
        tail = context[-size:]
        full = tokenizer.decode([*tail, token_id], skip_special_tokens=False)
        if full.endswith("\ufffd"):
            continue
        clean = len(tail)  # context tokens that are themselves part of the character do not count
        while clean and tokenizer.decode([tail[clean - 1]], skip_special_tokens=False).endswith(
            "\ufffd"
        ):
            clean -= 1
        prefix = tokenizer.decode(tail[:clean], skip_special_tokens=False) if clean else ""
        common = len(os.path.commonprefix([prefix, full]))
        return full[common:]
    return ""


def _render(tokenizer: Tokenizer, kind: Kind, state: _State) -> dict[str, Any]:
    choice = state.choice
    text = "".join(state.text)
    finish = finish_text(FinishReason.LENGTH if choice.echo_only else state.finish)
    if kind == "chat":
        return {
            "index": choice.index,
            "message": {"role": "assistant", "content": text},
            "logprobs": _chat_logprobs(tokenizer, choice, state.logprobs),
            "finish_reason": finish,
        }
    logprobs = None
    if choice.logprobs is not None:
        entries: list[TokenLogprobs | None] = []
        if choice.echo_text or choice.echo_only:
            entries = [None, *state.prompt_logprobs]
            prompt_ids = choice.request.prompt_token_ids
        else:
            prompt_ids = ()
        logprobs = _completion_logprobs(tokenizer, choice.logprobs, prompt_ids, entries, 0)
        generated = _completion_logprobs(
            tokenizer, choice.logprobs, (), list(state.logprobs), _end(logprobs)
        )
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            logprobs[key].extend(generated[key])
    rendered = {
        "index": choice.index,
        "text": choice.echo_text + text,
        "logprobs": logprobs,
        "finish_reason": finish,
    }
    prompt_logprobs = prompt_logprobs_body(tokenizer, state)
    if prompt_logprobs is not None:
        rendered["prompt_logprobs"] = prompt_logprobs
    return rendered


def _end(logprobs: dict[str, Any]) -> int:
    if not logprobs["tokens"]:
        return 0
    return int(logprobs["text_offset"][-1]) + len(logprobs["tokens"][-1])


def _completion_logprobs(
    tokenizer: Tokenizer,
    top: int,
    prompt_ids: tuple[int, ...],
    entries: list[TokenLogprobs | None],
    offset: int,
) -> dict[str, Any]:
    """vLLM's ``CompletionLogProbs``: ``entries[i]`` is ``None`` for the first prompt token
    (whose id comes from ``prompt_ids``)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for position, entry in enumerate(entries):
        token_id = entry.token_id if entry is not None else prompt_ids[position]
        token = tokenizer.decode([token_id])
        tokens.append(token)
        offsets.append(offset)
        offset += len(token)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(entry.logprob)
        best = {tokenizer.decode([i]): lp for i, lp in entry.top[:top]}
        best.setdefault(token, entry.logprob)
        tops.append(best if top > 0 else None)
    return {
        "text_offset": offsets,
        "token_logprobs": token_logprobs,
        "tokens": tokens,
        "top_logprobs": tops,
    }


def _chat_entry(tokenizer: Tokenizer, token_id: int, logprob: float) -> dict[str, Any]:
    token = tokenizer.decode([token_id])
    return {
        "token": token,
        "logprob": max(logprob, LOGPROB_FLOOR),
        "bytes": list(token.encode("utf-8", errors="replace")),
    }


def _chat_logprobs(
    tokenizer: Tokenizer, choice: Choice, entries: list[TokenLogprobs]
) -> dict[str, Any] | None:
    if choice.logprobs is None:
        return None
    content = []
    for entry in entries:
        item = _chat_entry(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [
            _chat_entry(tokenizer, i, lp) for i, lp in entry.top[: choice.logprobs]
        ]
        content.append(item)
    return {"content": content}


async def _sse(
    runtime: RouterRuntime,
    kind: Kind,
    endpoint: str,
    states: list[_State],
    firsts: list[Chunk],
    usage: StreamUsage,
) -> AsyncIterator[bytes]:
    request = states[0].choice.request
    created = now_s()
    tokenizer = runtime.tokenizer
    outcome = "client_disconnected"
    object_name = "text_completion" if kind == "completion" else "chat.completion.chunk"

    def event(state: _State, text: str, logprobs: list[TokenLogprobs], first: bool) -> bytes:
        choice = state.choice
        finish = finish_text(state.finish)
        rendered: dict[str, Any]
        if kind == "chat":
            delta: dict[str, Any] = {"content": text}
            if first:
                delta["role"] = "assistant"
            rendered = {
                "index": choice.index,
                "delta": delta,
                "logprobs": _chat_logprobs(tokenizer, choice, logprobs),
                "finish_reason": finish,
            }
        else:
            lp = None
            if choice.logprobs is not None:
                lp = _completion_logprobs(
                    tokenizer, choice.logprobs, (), list(logprobs), state.offset
                )
                state.offset = _end(lp) if lp["tokens"] else state.offset
            prefix = choice.echo_text if first else ""
            rendered = {
                "index": choice.index,
                "text": prefix + text,
                "logprobs": lp,
                "finish_reason": finish,
            }
        body: dict[str, Any] = {
            "id": request.request_id,
            "object": object_name,
            "created": created,
            "model": request.model,
            "choices": [rendered],
        }
        if usage == "continuous":  # this choice's tokens so far, as vLLM counts them
            body["usage"] = running_usage(state.info.prompt_tokens, state.info.completion_tokens)
        elif usage == "final":
            body["usage"] = None
        return sse_event(body)

    queue: asyncio.Queue[tuple[_State, Chunk | BaseException]] = asyncio.Queue()

    tasks: list[asyncio.Task[None]] = []
    try:
        for state, first in zip(states, firsts, strict=True):
            text, logprobs = _take(state, first)
            yield event(state, text, logprobs, True)
        pending = {id(s): s for s in states if s.finish is None}

        async def pump_one(state: _State) -> None:
            try:
                while True:
                    chunk = await anext(state.run)
                    queue.put_nowait((state, chunk))
                    if chunk.finish_reason is not None:
                        return
            except BaseException as exc:
                queue.put_nowait((state, exc))

        tasks = [asyncio.ensure_future(pump_one(s)) for s in pending.values()]
        while pending:
            state, item = await queue.get()
            if isinstance(item, BaseException):
                if isinstance(item, StopAsyncIteration):
                    raise EngineRequestFailed("stream ended early", code="decode_truncated")
                raise item
            text, logprobs = _take(state, item)
            if text or logprobs or state.finish is not None:
                yield event(state, text, logprobs, False)
            if state.finish is not None:
                pending.pop(id(state), None)
        if usage != "none":
            yield sse_event(
                {
                    "id": request.request_id,
                    "object": object_name,
                    "created": created,
                    "model": request.model,
                    "choices": [],
                    "usage": _usage(states),
                }
            )
        yield SSE_DONE
        outcome = "ok"
    except RouterError as exc:
        outcome = exc.code
        logger.warning("request %s failed mid-stream: %s", request.request_id, exc.message)
        yield sse_event(exc.envelope())
        yield SSE_DONE
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for state in states:
            await state.run.aclose()
        runtime.executor.observe_end(
            request.arrival_s, endpoint, outcome, states[0].info, _tokens(states)
        )
