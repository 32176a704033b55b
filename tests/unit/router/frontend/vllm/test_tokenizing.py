"""Huge prompts hold up nobody (issue 36), through vLLM's front end: a text prompt longer than
the context could hold is refused by its length, before it is tokenized; what is tokenized is
tokenized off the event loop (vLLM's renderer's thread pool), beside other requests' prompts
given the renderer more than one worker; a request's body is bounded before its JSON is
parsed. Scripted engines behind the router, the synthetic checkpoint's tokenizer (4,096 tokens
of context, at most 7 characters a token: 28,672 characters); tests/e2e/test_huge_prompts.py
runs the real stack."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from services.control_plane.wire import EngineRole
from services.router.frontend.vllm.config import RENDERER_WORKERS
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import MODEL, FakeFactory, http, prepared, sample

CONTEXT = 4096
MAX_CHARS = CONTEXT * 7
"""vLLM's bound of a prompt's characters for the context (``max_chars_per_token``)."""


def huge(chars: int) -> str:
    words = "hello world, this is a rather long prompt. "
    return (words * (chars // len(words) + 1))[:chars]


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


@pytest.fixture
def rt(factory: FakeFactory) -> RouterRuntime:
    return prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))


def body(endpoint: str, text: str, **fields: object) -> dict[str, object]:
    if endpoint == "/v1/completions":
        return {"model": MODEL, "prompt": text, "max_tokens": 2, **fields}
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_completion_tokens": 2,
        **fields,
    }


@pytest.fixture
def tokenized(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(characters, thread id)`` of every text the checkpoint's tokenizer encodes (recorded
    as the call starts); a test clears it once the app has started."""
    calls: list[tuple[int, int]] = []
    encode = PreTrainedTokenizerBase.__call__

    def recorded(self: Any, text: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(text, str):
            calls.append((len(text), threading.get_ident()))
        return encode(self, text, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerBase, "__call__", recorded)
    return calls


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_a_prompt_over_the_context_is_refused_by_its_length_before_it_is_tokenized(
    factory: FakeFactory, rt: RouterRuntime, tokenized: list[tuple[int, int]], endpoint: str
) -> None:
    text = huge(3_000_000)
    async with http(rt) as client:
        tokenized.clear()
        reply = await client.post(endpoint, json=body(endpoint, text))
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["param"] == "input_text"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert f"more than {MAX_CHARS} characters" in error["message"]
    assert all(chars <= MAX_CHARS for chars, _ in tokenized), tokenized
    assert not any(engine.prefills for engine in factory.engines.values())
    refused = sample(
        rt, "pdserve_router_requests_total", endpoint=endpoint, outcome="invalid_request"
    )
    assert refused == 1


async def test_a_prompt_just_over_the_context_is_refused_with_its_count(
    rt: RouterRuntime, tokenized: list[tuple[int, int]]
) -> None:
    """Under the characters' bound: tokenized (no further than one token past the context),
    off the event loop, then refused with vLLM's message."""
    loop_thread = threading.get_ident()
    async with http(rt) as client:
        tokenized.clear()
        reply = await client.post("/v1/completions", json=body("/v1/completions", huge(20_000)))
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "input_tokens"
    assert f"contains at least {CONTEXT + 1} input tokens" in error["message"]
    assert (20_000, loop_thread) not in tokenized
    assert [chars for chars, _ in tokenized] == [20_000]


async def test_a_huge_prompt_with_truncation_is_served_from_its_tail(
    factory: FakeFactory, rt: RouterRuntime, tokenized: list[tuple[int, int]]
) -> None:
    """``truncate_prompt_tokens`` (without ``truncation_side``): vLLM tokenizes the whole
    prompt, off the event loop, and the engines get <s> and its last tokens."""
    text = huge(3_000_000)
    loop_thread = threading.get_ident()
    async with http(rt) as client:
        tokenized.clear()
        reply = await client.post(
            "/v1/completions", json=body("/v1/completions", text, truncate_prompt_tokens=100)
        )
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["usage"]["prompt_tokens"] == 100
    assert tokenized and all(thread != loop_thread for _, thread in tokenized)
    prompt = factory.engines["d1"].decodes[-1].prompt_token_ids
    assert prompt == (256, *text[-99:].encode())  # <s>, then the text's last 99 bytes


async def test_a_small_request_is_answered_while_a_huge_prompt_is_tokenized(
    factory: FakeFactory, tokenized: list[tuple[int, int]]
) -> None:
    """The only prompt vLLM tokenizes whole past the context's bound of characters (one with
    ``truncate_prompt_tokens``) takes seconds; with the router's renderer workers
    (``config.RENDERER_WORKERS``), a small request's prompt is tokenized beside it and
    answered meanwhile. (With vLLM's default of one worker it waits for the huge one.)"""
    rt = prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))
    assert RENDERER_WORKERS > 1
    text = huge(3_000_000)
    async with http(rt) as client:
        tokenized.clear()
        huge_reply = asyncio.ensure_future(
            client.post(
                "/v1/completions", json=body("/v1/completions", text, truncate_prompt_tokens=100)
            )
        )
        for _ in range(6000):  # 60 s: generous on a loaded machine
            if any(chars == len(text) for chars, _ in tokenized):
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the huge prompt was not tokenized within 60 s")
        small = await client.post("/v1/completions", json=body("/v1/completions", "hi there"))
        assert small.status_code == 200, small.text
        # The event order: the small request was answered while the huge prompt was still
        # being tokenized (behind it, it would have waited for all of it).
        assert not huge_reply.done()
        reply = await huge_reply
    assert reply.status_code == 200, reply.text[:300]
    assert reply.json()["usage"]["prompt_tokens"] == 100


async def test_a_small_request_is_answered_beside_huge_prompts(
    rt: RouterRuntime, tokenized: list[tuple[int, int]]
) -> None:
    loop_thread = threading.get_ident()
    async with http(rt) as client:
        tokenized.clear()
        replies = await asyncio.gather(
            *(
                client.post("/v1/completions", json=body("/v1/completions", huge(3_000_000)))
                for _ in range(3)
            ),
            client.post("/v1/completions", json=body("/v1/completions", huge(20_000))),
            client.post("/v1/completions", json=body("/v1/completions", "hi there")),
        )
    *refused, small = replies
    assert [reply.status_code for reply in refused] == [400] * 4
    assert small.status_code == 200, small.text
    # Only what fits the context's bound of characters was tokenized, in the renderer's
    # threads, not on the event loop.
    assert sorted(chars for chars, _ in tokenized) == [len("hi there"), 20_000]
    assert all(thread != loop_thread for _, thread in tokenized)


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_a_body_over_the_bound_is_413_and_counted_under_its_endpoint(
    factory: FakeFactory, endpoint: str
) -> None:
    rt = prepared(
        factory,
        ("p1", EngineRole.PREFILL),
        ("d1", EngineRole.DECODE),
        max_request_body_bytes=65536,
    )

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(20):
            yield b"x" * 4096
        yield b'"}'

    async with http(rt) as client:
        declared = await client.post(endpoint, json=body(endpoint, huge(70_000)))
        streamed = await client.post(
            endpoint, content=chunks(), headers={"content-type": "application/json"}
        )
        within = await client.post(endpoint, json=body(endpoint, huge(60_000)))
    for reply in (declared, streamed):
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert error["code"] == 413
        assert "(65536 bytes, PDSERVE_ROUTER_MAX_REQUEST_BODY_BYTES)" in error["message"]
    # Within the bound: read and parsed (then refused by its length, which a 413 hides).
    assert within.status_code == 400, within.text
    assert within.json()["error"]["param"] == "input_text"
    refused = sample(
        rt, "pdserve_router_requests_total", endpoint=endpoint, outcome="request_too_large"
    )
    assert refused == 2
    assert not any(engine.prefills for engine in factory.engines.values())


async def test_a_body_sent_in_pieces_within_the_bound_is_read_whole(rt: RouterRuntime) -> None:
    """A chunked upload arrives as several ASGI messages: counted against the bound as they
    come, and all of them reach vLLM's app."""
    whole = httpx.Request("POST", "http://router/", json=body("/v1/completions", "hi there"))
    content = whole.read()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(content), 7):
            yield content[start : start + 7]

    headers = {"content-type": "application/json"}
    async with http(rt) as client:
        split = await client.post("/v1/completions", content=pieces(), headers=headers)
        at_once = await client.post("/v1/completions", content=content, headers=headers)
    assert split.status_code == 200, split.text
    assert split.json()["choices"] == at_once.json()["choices"]
    assert split.json()["usage"] == at_once.json()["usage"]


def test_httpx_sends_a_generator_body_chunked() -> None:
    # The chunked cases above depend on it: no Content-Length for an async generator body.
    request = httpx.Request("POST", "http://x/", content=iter([b"a"]))
    assert "content-length" not in request.headers
