"""Huge prompts hold up nobody (issue 36): the body bound before the JSON, long prompts
tokenized in a bounded pool off the event loop (a real HF tokenizer, the tiny model's), the
queue's 429, and a prompt over the context refused from its prefix. Scripted engines behind the
router; tests/e2e/test_huge_prompts.py runs the real stack."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.control_plane.wire import EngineRole
from services.engines.reference.tiny_model import make_tiny_model
from services.router.frontend.tokenizing import INLINE_CHARS, PREFIX_CHARS_PER_TOKEN
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import FakeFactory, http, prepared, sample, view

MODEL = "tiny"
HUGE_CHARS = 3_000_000
"""Seconds of tokenizing for the tiny model's tokenizer on this machine."""


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tokenizing") / "tiny-model")


def huge(chars: int = HUGE_CHARS) -> str:
    words = "hello world, this is a rather long prompt. "
    return (words * (chars // len(words) + 1))[:chars]


def router(tiny_model: Path, *, context: int = 0, **settings: object) -> RouterRuntime:
    # pdserve's own front end (its tokenizing pool), which a real tokenizer does not pick alone
    rt = prepared(FakeFactory(), tokenizer=tiny_model, frontend="pdserve", **settings)
    for engine_id, role in (("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE)):
        rt.pool.update(engine_id, view(engine_id, role, max_model_len=context))
    return rt


def completion(prompt: str, **body: object) -> dict[str, object]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0, **body}


async def until(condition: object, what: str) -> None:
    for _ in range(6000):  # 60 s: generous on a loaded machine
        if callable(condition) and condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{what}: not within 60 s")


async def test_a_small_request_is_answered_while_a_huge_prompt_is_tokenized(
    tiny_model: Path,
) -> None:
    rt = router(tiny_model)  # no context reported: the whole prompt is tokenized
    gaps: list[float] = []

    async def tick() -> None:  # the event loop's longest stall
        last = time.perf_counter()
        while True:
            await asyncio.sleep(0.005)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    ticker = asyncio.ensure_future(tick())
    try:
        async with http(rt) as client:
            started = time.perf_counter()
            huge_reply = asyncio.ensure_future(
                client.post("/v1/completions", json=completion(huge()))
            )
            await until(lambda: rt.prompts.waiting == 1, "the huge prompt is in the pool")
            await asyncio.sleep(0.2)  # its thread is encoding now
            small = await client.post("/v1/completions", json=completion("hi there"))
            assert small.status_code == 200, small.text
            # The event order: the small request was answered while the huge prompt was
            # still being tokenized (on the loop, it would have waited for all of it).
            assert rt.prompts.waiting == 1 and not huge_reply.done()
            reply = await huge_reply
            elapsed = time.perf_counter() - started
    finally:
        ticker.cancel()
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens"] > HUGE_CHARS // 10
    # Nothing held the loop for long: an encode holding the GIL would stall it for about all
    # of ``elapsed`` (a ratio, not a time: it holds on a loaded machine).
    assert max(gaps) < elapsed / 2, (max(gaps), elapsed)


async def test_a_full_tokenizing_queue_answers_429_and_short_prompts_still_pass(
    tiny_model: Path,
) -> None:
    rt = router(tiny_model, tokenize_workers=1, tokenize_queue=1)
    async with http(rt) as client:
        first = asyncio.ensure_future(client.post("/v1/completions", json=completion(huge())))
        await until(lambda: rt.prompts.waiting == 1, "the huge prompt is in the pool")
        refused = await client.post("/v1/completions", json=completion(huge(INLINE_CHARS + 1)))
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert error["code"] == "rate_limit_exceeded"
        assert "PDSERVE_ROUTER_TOKENIZE_QUEUE=1" in error["message"]
        short = await client.post("/v1/completions", json=completion(huge(INLINE_CHARS)))
        assert short.status_code == 200, short.text  # tokenized on the loop
        assert (await first).status_code == 200
        after = await client.post("/v1/completions", json=completion(huge(INLINE_CHARS + 1)))
        assert after.status_code == 200, after.text  # the place was freed
    refusals = sample(
        rt,
        "pdserve_router_requests_total",
        endpoint="/v1/completions",
        outcome="rate_limit_exceeded",
    )
    assert refusals == 1


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
async def test_a_prompt_over_the_context_is_refused_from_its_prefix(
    tiny_model: Path, endpoint: str
) -> None:
    context = 128
    rt = router(tiny_model, context=context)
    text = huge(1_000_000)
    body: dict[str, object] = (
        completion(text)
        if endpoint == "/v1/completions"
        else {
            "model": MODEL,
            "messages": [{"role": "user", "content": text}],
            "max_completion_tokens": 2,
        }
    )
    async with http(rt) as client:
        reply = await client.post(endpoint, json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "input_tokens"
    assert f"maximum context length is {context} tokens" in error["message"]
    assert f"its first {context * PREFIX_CHARS_PER_TOKEN} of " in error["message"]


async def test_a_prompt_just_over_the_context_is_refused_with_its_count(
    tiny_model: Path,
) -> None:
    # Under the prefix's length: tokenized whole, refused with vLLM's message and its count.
    rt = router(tiny_model, context=128)
    async with http(rt) as client:
        reply = await client.post("/v1/completions", json=completion(huge(INLINE_CHARS + 100)))
    assert reply.status_code == 400, reply.text
    assert "However, your prompt contains " in reply.json()["error"]["message"]


async def test_a_body_over_the_bound_is_refused_before_it_is_parsed(tiny_model: Path) -> None:
    rt = router(tiny_model, max_request_body_bytes=65536)
    oversized = completion(huge(70_000))
    async with http(rt) as client:
        declared = await client.post("/v1/completions", json=oversized)

        async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: chunked
            yield b'{"model": "tiny", "prompt": "'
            for _ in range(20):
                yield b"x" * 4096
            yield b'"}'

        streamed = await client.post(
            "/v1/completions",
            content=chunks(),
            headers={"content-type": "application/json"},
        )
        within = await client.post("/v1/completions", json=completion(huge(60_000)))
    for reply in (declared, streamed):
        assert reply.status_code == 413, reply.text
        error = reply.json()["error"]
        assert error["code"] == "request_too_large"
        assert error["type"] == "invalid_request_error"
        assert "(65536 bytes, PDSERVE_ROUTER_MAX_REQUEST_BODY_BYTES)" in error["message"]
    assert within.status_code == 200, within.text
    assert (
        sample(
            rt,
            "pdserve_router_requests_total",
            endpoint="/v1/completions",
            outcome="request_too_large",
        )
        == 2
    )


def test_httpx_sends_a_generator_body_chunked() -> None:
    # The chunked case above depends on it: no Content-Length for an async generator body.
    request = httpx.Request("POST", "http://x/", content=iter([b"a"]))
    assert "content-length" not in request.headers
