"""The router's HTTP layer (vLLM's OpenAI front end over pdserve's executor) with the official
``openai`` client, over fake engine connectors.

In-process (httpx's ASGI transport) so each case costs milliseconds; the same client against
real processes is in tests/e2e/test_router*.py. The answers' text is vLLM's detokenization of
the fakes' token ids with the synthetic checkpoint's tokenizer (ids below 256 are bytes): the
prefill's token 7 then the decode's 101, 102... read ``"\\x07efg..."``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest
from vllm.entrypoints.serve.middleware import authenticate

from services.control_plane.wire import EngineRole
from services.engines.errors import EngineOverloaded, InvalidRequest, UnknownKVHandle
from services.router.main import create_app
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import MODEL, FakeFactory, http, prepared, sample, text_of, view

CONTEXT = 4096
"""The synthetic checkpoint's context (``fakes.checkpoint``)."""


FOUR = text_of(7, 101, 102, 103)
"""The text of a four-token answer: the prefill's token, then the decode's."""


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


@pytest.fixture
def rt(factory: FakeFactory) -> RouterRuntime:
    return prepared(
        factory, ("p1", EngineRole.PREFILL), ("p2", EngineRole.PREFILL), ("d1", EngineRole.DECODE)
    )


@pytest.fixture
async def transport(rt: RouterRuntime) -> AsyncIterator[httpx.AsyncClient]:
    async with http(rt) as client:
        yield client


@pytest.fixture
def client(transport: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url="http://router/v1", api_key="unused", http_client=transport, max_retries=0
    )


def outcome(rt: RouterRuntime, name: str, endpoint: str = "/v1/completions") -> float:
    return sample(rt, "pdserve_router_requests_total", endpoint=endpoint, outcome=name)


async def test_completion_goes_through_a_prefill_and_a_decode_engine(client, factory, rt):
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt="hello there", max_tokens=4, temperature=0
    )
    completion = raw.parse()
    assert completion.choices[0].text == FOUR
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4
    assert completion.usage.prompt_tokens == len("hello there") + 1  # bytes after <s>
    assert raw.headers["x-pdserve-prefill-engine"] in {"p1", "p2"}
    assert raw.headers["x-pdserve-decode-engine"] == "d1"
    assert raw.headers["x-pdserve-execution-path"] == "disaggregated"
    decode = factory.engines["d1"].decodes[-1]
    assert decode.kv_handle is not None and decode.first_token_id == 7
    assert decode.prompt_token_ids == (256, *b"hello there")
    assert sample(rt, "pdserve_router_execution_path_total", path="disaggregated") == 1
    assert outcome(rt, "ok") == 1
    prompt_sum = sample(rt, "pdserve_router_request_prompt_tokens_sum")
    assert prompt_sum == completion.usage.prompt_tokens
    assert sample(rt, "pdserve_router_request_generation_tokens_sum") == 4
    assert sample(rt, "pdserve_router_request_generation_tokens_count") == 1


async def test_token_figures_count_the_prompt_once_per_choice_and_every_choice(client, rt):
    """n choices of one prompt (streamed): vLLM's front end runs a run per choice, so the
    router counts the prompt's tokens once per choice (its engines were asked for each), and
    every choice's tokens; one request observed."""
    stream = await client.completions.create(
        model=MODEL,
        prompt="hello there",
        max_tokens=3,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage async for chunk in stream if chunk.usage is not None][-1]
    assert usage.completion_tokens == 6
    assert sample(rt, "pdserve_router_request_prompt_tokens_sum") == 2 * usage.prompt_tokens
    assert sample(rt, "pdserve_router_request_generation_tokens_sum") == 6
    assert sample(rt, "pdserve_router_request_prompt_tokens_count") == 1


async def test_only_a_non_streamed_request_decodes_with_one_unary_call(client, factory, rt):
    """A non-streamed request's decode is one ``decode_once`` carrying the router's idle bound
    (the engine enforces it); a streamed one streams, one message per step."""
    once = await client.completions.create(model=MODEL, prompt="hello there", max_tokens=4)
    assert once.choices[0].text == FOUR
    stream = await client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=4, stream=True
    )
    text = "".join([chunk.choices[0].text async for chunk in stream])
    assert text == FOUR
    engine = factory.engines["d1"]
    assert len(engine.decodes) == 2 and engine.once == [engine.decodes[0].request_id]
    assert engine.idle_bounds == [rt.settings.decode_idle_timeout_s]


async def test_chat_stream_with_usage_ends_with_done(transport):
    """As vLLM's server streams it: the role in a first chunk of its own, the text, a usage
    chunk with no choices, ``[DONE]``."""
    response = await transport.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    assert response.headers["x-pdserve-decode-engine"] == "d1"
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == text_of(7, 101, 102)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # The chat template's rendering: "<s>user: hi\nassistant:"
    assert chunks[-1]["usage"]["prompt_tokens"] == 1 + len("user: hi\nassistant:")


@pytest.mark.parametrize("n", [1, 2])
async def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, n):
    """vLLM's ``stream_options.continuous_usage_stats`` (guidellm streams with it): each chunk
    carries the usage so far (per choice), then the usual last usage chunk."""
    stream = await client.completions.create(
        model=MODEL,
        prompt="hello there",
        max_tokens=3,
        n=n,
        stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = [chunk async for chunk in stream]
    *with_text, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 3 * n
    seen: dict[int, list[int]] = {}
    for chunk in with_text:
        assert chunk.usage is not None
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + chunk.usage.completion_tokens
        seen.setdefault(chunk.choices[0].index, []).append(chunk.usage.completion_tokens)
    # Counted per choice, as vLLM does: growing to the choice's tokens.
    assert sorted(seen) == list(range(n))
    for counts in seen.values():
        assert counts == sorted(counts) and counts[-1] == 3


async def test_continuous_usage_stats_without_include_usage_add_nothing(client):
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": False, "continuous_usage_stats": True},
    )
    chunks = [chunk async for chunk in stream]
    assert chunks and all(chunk.usage is None and chunk.choices for chunk in chunks)


async def test_fields_vllm_does_not_know_are_ignored(transport, factory):
    """As vLLM's server: ``best_of`` (gone from vLLM's models), a removed guided-decoding field
    (nothing is constrained: not refused by the reference engines, which cannot constrain) and
    any other unknown field, top level or in ``stream_options``, are ignored."""
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": 2,
        "best_of": 3,
        "guided_json": {"type": "object"},
        "some_client_field": [1, 2],
    }
    plain = await transport.post("/v1/completions", json=body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["choices"][0]["text"] == text_of(7, 101)
    assert factory.engines["d1"].decodes[-1].sampling.structured_outputs == ""
    streamed = await transport.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True, "future_option": True},
            "some_client_field": 1,
        },
    )
    assert streamed.status_code == 200, streamed.text
    assert streamed.text.endswith("data: [DONE]\n\n")


async def test_openai_client_streams_chat(client):
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    assert text == text_of(7, 101, 102)
    assert usage is not None and usage.completion_tokens == 3


async def test_stop_string_is_passed_to_the_engine_and_not_returned(client, factory):
    """The engine gets the stop string; the router's detokenizer (vLLM's) ends the text there
    (the fakes never see it: their own text is different)."""
    completion = await client.completions.create(
        model=MODEL, prompt="count", max_tokens=10, stop=["g"]
    )
    assert completion.choices[0].text == text_of(7, 101, 102)
    assert completion.choices[0].finish_reason == "stop"
    assert factory.engines["d1"].decodes[-1].sampling.stop == ("g",)


async def test_a_failed_prefill_is_retried_on_another_engine_and_counted(client, factory, rt):
    factory.engines["p1"].prefill_error = EngineOverloaded("queue full")
    factory.engines["p2"].prefill_error = None
    for _ in range(2):  # whichever engine comes first, p1 is tried at least once
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt="hello there", max_tokens=2
        )
        assert raw.parse().choices[0].text == text_of(7, 101)
        assert raw.headers["x-pdserve-prefill-engine"] == "p2"
    assert factory.engines["p1"].prefills
    assert (
        sample(
            rt, "pdserve_router_prefill_retries_total", phase="prefill", reason="engine_overloaded"
        )
        >= 1
    )
    assert sample(rt, "pdserve_router_execution_path_total", path="retried") >= 1


async def test_when_every_prefill_fails_the_request_falls_back_to_local_and_is_counted(
    client, factory, rt
):
    for engine_id in ("p1", "p2"):
        factory.engines[engine_id].prefill_error = EngineOverloaded("queue full")
    raw = await client.completions.with_raw_response.create(model=MODEL, prompt="abc", max_tokens=2)
    # Run on the decode engine alone: its tokens from the first (100, 101).
    assert raw.parse().choices[0].text == text_of(100, 101)
    assert raw.headers["x-pdserve-execution-path"] == "local"
    assert "x-pdserve-prefill-engine" not in raw.headers
    assert raw.headers["x-pdserve-decode-engine"] == "d1"
    assert factory.engines["d1"].decodes[-1].kv_handle is None
    assert sample(rt, "pdserve_router_fallbacks_total", reason="prefill_failed") == 1
    assert sample(rt, "pdserve_router_queue_time_seconds_count") == 1


async def test_bad_input_reported_by_the_prefill_engine_is_a_400_and_not_retried(
    client, factory, rt
):
    factory.engines["p1"].prefill_error = InvalidRequest("prompt longer than 512 tokens")
    factory.engines["p2"].prefill_error = InvalidRequest("prompt longer than 512 tokens")
    with pytest.raises(openai.BadRequestError, match="longer than 512") as caught:
        await client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert caught.value.body["code"] == 400  # type: ignore[index]  # vLLM's envelope
    assert len(factory.engines["p1"].prefills) + len(factory.engines["p2"].prefills) == 1
    assert outcome(rt, "invalid_request") == 1


async def test_decode_failure_after_streaming_started_ends_with_an_error_event(factory):
    rt = prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE), max_migrations=0)
    factory.connect(rt.pool.slots()[1].record)
    factory.engines["d1"].fail_decode_after = 2
    async with http(rt) as transport:
        client = openai.AsyncOpenAI(
            base_url="http://router/v1", api_key="unused", http_client=transport, max_retries=0
        )
        stream = await client.completions.create(
            model=MODEL, prompt="abc", max_tokens=8, stream=True
        )
        received = []
        with pytest.raises(openai.APIError, match="rank 0 died"):
            async for chunk in stream:
                received.append(chunk.choices[0].text)
    # The prefill's token came first, then every token made before the failure: none is
    # replaced by the error (the engine client reads on only once the client took each).
    assert received[0] == text_of(7)
    assert "".join(received) == text_of(7, 101, 102)
    assert outcome(rt, "decode_failed") == 1


async def test_a_truncated_decode_stream_is_an_error_not_a_short_answer(client, factory, rt):
    factory.engines["d1"].truncate_after = 1
    with pytest.raises(openai.APIStatusError, match="without a finish reason") as caught:
        await client.completions.create(model=MODEL, prompt="abc", max_tokens=8)
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == 502  # type: ignore[index]
    # Counted once, under the router's code.
    assert outcome(rt, "decode_truncated") == 1
    assert sum(outcome(rt, name) for name in ("ok", "internal_error", "bad_gateway")) == 0
    assert sample(rt, "pdserve_router_e2e_latency_seconds_count", endpoint="/v1/completions") == 1


async def test_decode_refusing_the_handle_is_an_error_and_the_held_kv_is_released(
    client, factory, rt
):
    factory.engines["d1"].decode_error = UnknownKVHandle("no such handle")
    with pytest.raises(openai.APIStatusError, match="no such handle") as caught:
        await client.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    assert caught.value.status_code == 502
    assert outcome(rt, "kv_handle_unknown") == 1
    await rt.executor.calls.close()  # the aborts are sent in the background
    prefilled = [p for engine in ("p1", "p2") for p in factory.engines[engine].prefills]
    aborted = [p for engine in ("p1", "p2") for p in factory.engines[engine].aborted]
    assert prefilled and sorted(aborted) == sorted(prefilled)


@pytest.mark.parametrize(
    ("body", "status", "param", "says"),
    [
        ({"model": "nope", "prompt": "a"}, 404, "model", "The model `nope` does not exist"),
        ({"model": MODEL, "prompt": "a", "temperature": -1}, 400, "temperature", "non-negative"),
        ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "max_tokens", "at least 1"),
        ({"model": MODEL, "prompt": "a", "max_tokens": CONTEXT + 1}, 400, "max_tokens", "4096"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt", "non-empty"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, None, "out of vocabulary"),
        ({"model": MODEL, "prompt": "a", "n": 2, "temperature": 0}, 400, None, "greedy"),
        ({"model": MODEL, "prompt": "a", "stop": ["x"] * 17}, 400, "body.stop", "at most 4"),
        ({"model": MODEL, "prompt": "a", "suffix": "b"}, 400, "suffix", "suffix"),
    ],
)
async def test_bad_requests_get_the_openai_error_envelope(rt, transport, body, status, param, says):
    response = await transport.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    assert error["param"] == param
    assert says in error["message"]
    expected = "model_not_found" if status == 404 else "invalid_request"
    assert outcome(rt, expected) == 1


@pytest.mark.parametrize("nested", [False, True])
async def test_a_token_id_prompt_over_the_context_gets_the_error_envelope(transport, nested):
    token_ids = [1] * (CONTEXT + 1)
    body = {"model": MODEL, "prompt": [token_ids] if nested else token_ids}
    response = await transport.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == 400
    assert error["param"] == "input_tokens"
    assert f"maximum context length is {CONTEXT} tokens" in error["message"]
    assert f"(parameter=input_tokens, value={CONTEXT + 1})" in error["message"]


async def test_routing_and_parsing_errors_answer_as_vllms_server(transport):
    missing = await transport.get("/v1/nothing")
    wrong_method = await transport.get("/v1/completions")
    not_json = await transport.post(
        "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
    )
    # FastAPI's own answers, as vLLM's server gives them
    assert missing.status_code == 404 and missing.json() == {"detail": "Not Found"}
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {"detail": "Method Not Allowed"}
    assert not_json.status_code == 400
    error = not_json.json()["error"]
    assert error["code"] == 400 and "JSON decode error" in error["message"]


async def test_api_keys_are_checked_in_constant_time_against_every_key(factory, monkeypatch):
    """``api_keys`` become vLLM's ``--api-key``: every ``/v1`` route needs one of them as a
    Bearer token, compared (as SHA-256 digests) with ``compare_digest`` against every key
    whichever matches; ``/health`` and ``/metrics`` stay open (probes, Prometheus)."""
    compared: list[tuple[bytes, bytes]] = []

    def compare_digest(a: bytes, b: bytes) -> bool:
        compared.append((a, b))
        return a == b

    monkeypatch.setattr(authenticate, "secrets", SimpleNamespace(compare_digest=compare_digest))
    rt = prepared(factory, ("both", EngineRole.BOTH), api_keys=["secret-1", "secret-2"])
    async with http(rt) as transport:

        def client(key: str) -> openai.AsyncOpenAI:
            return openai.AsyncOpenAI(
                base_url="http://router/v1", api_key=key, http_client=transport, max_retries=0
            )

        for key in ("secret-1", "secret-2"):
            compared.clear()
            completion = await client(key).completions.create(model=MODEL, prompt="a", max_tokens=1)
            assert completion.choices[0].text == text_of(100)  # run locally on "both"
            assert len(compared) == 2  # both keys, the match first or not
        for key in ("wrong", "secret-", "secret-22"):
            compared.clear()
            with pytest.raises(openai.AuthenticationError):
                await client(key).completions.create(model=MODEL, prompt="a", max_tokens=1)
            assert len(compared) == 2
        missing = await transport.get("/v1/models")
        assert missing.status_code == 401 and missing.json() == {"error": "Unauthorized"}
        basic = await transport.get("/v1/models", headers={"authorization": "Basic secret-1"})
        assert basic.status_code == 401
        assert (await transport.get("/health")).status_code == 200
        assert (await transport.get("/metrics")).status_code == 200
    # A refused generation request is counted as one.
    assert outcome(rt, "invalid_api_key") == 3
    assert outcome(rt, "ok") == 2


async def test_generation_routes_check_the_key_before_the_body(factory):
    keyed = prepared(factory, ("both", EngineRole.BOTH), api_keys=["k"])
    async with http(keyed) as transport:
        for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
            unkeyed = await transport.post(
                path, content=b"{nope", headers={"content-type": "application/json"}
            )
            assert unkeyed.status_code == 401, path
            assert unkeyed.json() == {"error": "Unauthorized"}
            keyed_answer = await transport.post(
                path,
                content=b"{nope",
                headers={"content-type": "application/json", "authorization": "Bearer k"},
            )
            assert keyed_answer.status_code == 400, path
    assert not any(engine.prefills for engine in factory.engines.values())


async def test_bodies_are_refused_as_vllms_server_refuses_them(transport):
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 2}

    async def refused(content: bytes, content_type: str = "application/json") -> dict[str, Any]:
        response = await transport.post(
            "/v1/completions", content=content, headers={"content-type": content_type}
        )
        assert response.status_code == 400, response.text
        error: dict[str, Any] = response.json()["error"]
        assert error["code"] == 400
        return error

    assert (await refused(b""))["param"] == "body"
    assert "valid dictionary" in (await refused(b"[1]"))["message"]
    assert (
        "Only 'application/json'"
        in (await refused(json.dumps(good).encode(), "text/plain"))["message"]
    )
    extra = await transport.post("/v1/completions", json={**good, "bogus": 1})
    assert extra.status_code == 200, extra.text  # ignored, as vLLM's server does
    negative = await refused(json.dumps({**good, "max_tokens": -1}).encode())
    assert negative["param"] == "max_tokens"
    ok = await transport.post(
        "/v1/completions",
        content=json.dumps(good),
        headers={"content-type": "application/json; charset=utf-8"},
    )
    assert ok.status_code == 200
    assert ok.json()["choices"][0]["text"] == text_of(7, 101)


async def test_a_request_without_a_model_is_served_by_the_only_model(transport):
    """vLLM's server takes the model it serves when the request names none."""
    answer = await transport.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert answer.json()["model"] == MODEL


async def test_health_needs_a_ready_pair_and_models_lists_the_served_model(factory):
    rt = prepared(factory, ("d1", EngineRole.DECODE))
    async with http(rt) as transport:
        not_ready = await transport.get("/health")
        assert not_ready.status_code == 503
        assert not_ready.json()["error"]["code"] == "not_ready"
        rt.pool.update("p1", view("p1", EngineRole.PREFILL))
        ready = await transport.get("/health")
        assert ready.status_code == 200
        assert ready.json() == {
            "status": "ok",
            "models": [MODEL],
            "control_plane": {"reachable": True, "unreachable_s": 0.0, "held": []},
        }
        listed = await transport.get("/v1/models")
    assert listed.status_code == 200
    assert [m["id"] for m in listed.json()["data"]] == [MODEL]
    # As vLLM's server lists it: the checkpoint's context.
    assert listed.json()["data"][0]["max_model_len"] == CONTEXT


async def test_health_is_503_until_the_pool_has_synced(factory):
    rt = prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))
    rt.pool._synced.clear()
    async with http(rt) as transport:
        unsynced = await transport.get("/health")
    assert unsynced.status_code == 503
    assert "not synced" in unsynced.json()["error"]["message"]


async def test_metrics_are_the_routers_registry(transport, rt):
    await transport.post("/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2})
    scraped = await transport.get("/metrics")
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain")
    line = 'pdserve_router_requests_total{endpoint="/v1/completions",outcome="ok"} 1.0'
    assert line in scraped.text.splitlines()


async def test_no_engine_for_the_request_is_a_503(factory):
    """The model is served, but no decode engine is READY: 503 (streamed too: nothing was
    generated), counted under the router's code."""
    rt = prepared(factory, ("p1", EngineRole.PREFILL), local_fallback=False)
    async with http(rt) as transport:
        answer = await transport.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
        )
        streamed = await transport.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True}
        )
    for reply in (answer, streamed):
        assert reply.status_code == 503, reply.text
        assert reply.headers["content-type"] == "application/json"
        error = reply.json()["error"]
        assert error["code"] == 503
        assert error["message"] == f"no READY decode engine serves '{MODEL}'"
    assert outcome(rt, "no_engine_available") == 2
    assert not factory.engines["p1"].prefills


async def test_a_served_model_no_engine_registers_is_a_503_naming_the_cause(factory):
    """The checkpoint's model, but the control plane's engines serve another one (or none: a
    Redis back empty): the model is configured, so not a 404 (issue 49)."""
    rt = prepared(factory)
    rt.pool.update("x", view("x", EngineRole.BOTH, model="other"))
    async with http(rt) as transport:
        answer = await transport.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
        )
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["message"] == (
        f"no engine registered in the control plane serves '{MODEL}' (they serve other)"
    )
    assert outcome(rt, "no_engine_available") == 1


async def test_a_parameter_an_engine_kind_cannot_honour_is_a_400_naming_the_engine(factory):
    """A kind pdserve does not know gets only the parameters every engine had: the request is
    refused, never run without the parameter."""
    rt = prepared(factory, ("p1", EngineRole.PREFILL))
    rt.pool.update("d1", view("d1", EngineRole.DECODE, engine_kind="future"))
    async with http(rt) as transport:
        refused = await transport.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "a", "max_tokens": 2, "presence_penalty": 0.5},
        )
        plain = await transport.post(
            "/v1/completions", json={"model": MODEL, "prompt": "a", "max_tokens": 2}
        )
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "presence_penalty"
    assert "engine d1 (future engine)" in error["message"]
    assert plain.status_code == 200, plain.text
    assert "d1" not in factory.engines or not factory.engines["d1"].prefills
    assert outcome(rt, "unsupported_parameter") == 1


async def test_max_tokens_one_finishes_at_the_prefill(client, factory):
    completion = await client.completions.create(model=MODEL, prompt="abc", max_tokens=1)
    assert completion.choices[0].text == text_of(7)
    assert not factory.engines["d1"].decodes


async def test_seed_and_sampling_parameters_reach_the_engine(client, factory):
    await client.completions.create(
        model=MODEL,
        prompt="abc",
        max_tokens=3,
        temperature=0.7,
        top_p=0.9,
        seed=42,
        extra_body={"top_k": 5},
    )
    sampling = factory.engines["d1"].decodes[-1].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (
        0.7,
        0.9,
        5,
        42,
    )


async def test_concurrent_requests_each_get_their_own_headers(transport, factory):
    """The headers are per request (a context variable), not the last run's: each answer names
    the prefill engine that prefilled it."""
    answers = await asyncio.gather(
        *(
            transport.post(
                "/v1/completions", json={"model": MODEL, "prompt": f"p{i}", "max_tokens": 2}
            )
            for i in range(6)
        )
    )
    for answer in answers:
        assert answer.status_code == 200, answer.text
        named = factory.engines[answer.headers["x-pdserve-prefill-engine"]]
        assert any(request.startswith(answer.json()["id"]) for request in named.prefills)
        assert answer.headers["x-pdserve-decode-engine"] == "d1"
    assert all(factory.engines[engine].prefills for engine in ("p1", "p2"))


@pytest.mark.parametrize("stream", [False, True])
async def test_a_bug_in_the_router_is_a_500_counted_as_an_internal_error(rt, stream):
    """An exception no one expected (a bug): vLLM's 500 with its envelope (before the stream
    starts: nothing was generated), and the request counted ``internal_error``."""

    async def broken(*args: object, **kwargs: object) -> AsyncIterator[object]:
        raise RuntimeError("a bug")
        yield  # (an async generator, as the executor's runs are)

    rt.executor.generate = broken
    app = create_app(rt.settings, runtime=rt)
    async with app.router.lifespan_context(app):
        # Starlette re-raises the error after its 500 is sent (for the server to log it): the
        # client sees the 500.
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            answer = await client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": stream},
            )
    assert answer.status_code == 500, answer.text
    assert answer.headers["content-type"] == "application/json"
    error = answer.json()["error"]
    assert error["code"] == 500 and "a bug" in error["message"]
    assert outcome(rt, "internal_error") == 1
