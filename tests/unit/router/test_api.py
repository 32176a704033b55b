"""The router's HTTP layer with the official ``openai`` client, over fake engine connectors.

In-process (httpx's ASGI transport) so each case costs milliseconds; the same client against
real processes is in tests/e2e/test_router*.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

import openai
import pytest

from services.control_plane.wire import EngineRole
from services.engines.errors import EngineOverloaded, InvalidRequest, UnknownKVHandle
from services.router.frontend.protocol import MAX_PROMPT_TOKEN_IDS
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import FakeFactory, http, prepared, sample, view

MODEL = "tiny"


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


@pytest.fixture
def rt(factory: FakeFactory) -> RouterRuntime:
    return prepared(
        factory, ("p1", EngineRole.PREFILL), ("p2", EngineRole.PREFILL), ("d1", EngineRole.DECODE)
    )


@pytest.fixture
async def client(rt: RouterRuntime) -> AsyncIterator[openai.AsyncOpenAI]:
    async with http(rt) as transport:
        yield openai.AsyncOpenAI(
            base_url="http://router/v1", api_key="unused", http_client=transport, max_retries=0
        )


async def test_completion_goes_through_a_prefill_and_a_decode_engine(client, factory, rt):
    raw = await client.completions.with_raw_response.create(
        model=MODEL, prompt="hello there", max_tokens=4, temperature=0
    )
    completion = raw.parse()
    assert completion.choices[0].text == " w0 w1 w2 w3"
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None
    assert completion.usage.completion_tokens == 4
    assert raw.headers["x-pdserve-prefill-engine"] in {"p1", "p2"}
    assert raw.headers["x-pdserve-decode-engine"] == "d1"
    assert raw.headers["x-pdserve-execution-path"] == "disaggregated"
    decode = factory.engines["d1"].decodes[-1]
    assert decode.kv_handle is not None and decode.first_token_id == 7
    assert sample(rt, "pdserve_router_execution_path_total", path="disaggregated") == 1
    assert (
        sample(rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome="ok") == 1
    )
    prompt_sum = sample(rt, "pdserve_router_request_prompt_tokens_sum")
    assert prompt_sum == completion.usage.prompt_tokens > 0
    assert sample(rt, "pdserve_router_request_generation_tokens_sum") == 4
    assert sample(rt, "pdserve_router_request_generation_tokens_count") == 1


async def test_token_figures_count_a_prompt_once_and_every_choice(client, rt):
    """n choices of one prompt (streamed): the prompt's tokens once, every choice's tokens."""
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
    assert sample(rt, "pdserve_router_request_prompt_tokens_sum") == usage.prompt_tokens
    assert sample(rt, "pdserve_router_request_generation_tokens_sum") == 6
    assert sample(rt, "pdserve_router_request_prompt_tokens_count") == 1


async def test_only_a_non_streamed_request_decodes_with_one_unary_call(client, factory, rt):
    """A non-streamed request's decode is one ``decode_once`` carrying the router's idle bound
    (the engine enforces it); a streamed one streams, one message per step."""
    once = await client.completions.create(model=MODEL, prompt="hello there", max_tokens=4)
    assert once.choices[0].text == " w0 w1 w2 w3"
    stream = await client.completions.create(
        model=MODEL, prompt="hello there", max_tokens=4, stream=True
    )
    text = "".join([chunk.choices[0].text async for chunk in stream])
    assert text == " w0 w1 w2 w3"
    engine = factory.engines["d1"]
    assert len(engine.decodes) == 2 and engine.once == [engine.decodes[0].request_id]
    assert engine.idle_bounds == [rt.settings.decode_idle_timeout_s]


async def test_chat_stream_with_usage_ends_with_done(rt):
    async with http(rt) as transport:
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
    events = [line for line in response.text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert '"role":"assistant"' in events[0]
    assert '"choices":[]' in events[-2] and '"completion_tokens":3' in events[-2]
    assert '"cached_tokens":0' in events[-2]


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


async def test_fields_vllm_does_not_know_are_ignored_logged_once_and_counted(rt, caplog):
    """As vLLM's server: ``best_of`` (gone from vLLM's models), a removed guided-decoding field
    (with a warning that nothing is constrained) and any other unknown field, top level or in
    ``stream_options``, are ignored; the router counts each and logs each name once."""
    caplog.set_level(logging.INFO, logger="services.router.frontend.api")
    body = {
        "model": MODEL,
        "prompt": "hello there",
        "max_tokens": 2,
        "best_of": 3,
        "guided_json": {"type": "object"},
        "some_client_field": [1, 2],
    }
    async with http(rt) as transport:
        for _ in range(2):
            plain = await transport.post("/v1/completions", json=body)
            assert plain.status_code == 200, plain.text
            assert plain.json()["choices"][0]["text"] == " w0 w1"
        streamed = await transport.post(
            "/v1/chat/completions",
            json={
                "model": MODEL,
                "messages": [{"role": "user", "content": "hi"}],
                "stream": True,
                "stream_options": {"include_usage": True, "future_option": True},
                "some_client_field": 1,
            },
        )
        assert streamed.status_code == 200, streamed.text
    counted = {
        name: sample(rt, "pdserve_router_ignored_fields_total", field=name)
        for name in ("best_of", "guided_json", "some_client_field", "stream_options.future_option")
    }
    assert counted == {
        "best_of": 2,
        "guided_json": 2,
        "some_client_field": 3,
        "stream_options.future_option": 1,
    }
    assert caplog.text.count("'guided_json'") == 1 and "NOT constrained" in caplog.text
    assert caplog.text.count("'some_client_field'") == 1


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
    assert text == " w0 w1 w2"
    assert usage is not None and usage.completion_tokens == 3


async def test_stop_string_is_passed_to_the_engine_and_not_returned(client):
    completion = await client.completions.create(
        model=MODEL, prompt="count", max_tokens=10, stop=[" w3"]
    )
    assert completion.choices[0].text == " w0 w1 w2"
    assert completion.choices[0].finish_reason == "stop"


async def test_a_failed_prefill_is_retried_on_another_engine_and_counted(client, factory, rt):
    factory.engines["p1"].prefill_error = EngineOverloaded("queue full")
    factory.engines["p2"].prefill_error = None
    for _ in range(2):  # whichever engine comes first, p1 is tried at least once
        raw = await client.completions.with_raw_response.create(
            model=MODEL, prompt="hello there", max_tokens=2
        )
        assert raw.parse().choices[0].text == " w0 w1"
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
    assert raw.parse().choices[0].text == " w0 w1"
    assert raw.headers["x-pdserve-execution-path"] == "local"
    assert "x-pdserve-prefill-engine" not in raw.headers
    assert factory.engines["d1"].decodes[-1].kv_handle is None
    assert sample(rt, "pdserve_router_fallbacks_total", reason="prefill_failed") == 1
    assert sample(rt, "pdserve_router_queue_time_seconds_count") == 1


async def test_bad_input_reported_by_the_prefill_engine_is_a_400_and_not_retried(client, factory):
    factory.engines["p1"].prefill_error = InvalidRequest("prompt longer than 512 tokens")
    factory.engines["p2"].prefill_error = InvalidRequest("prompt longer than 512 tokens")
    with pytest.raises(openai.BadRequestError, match="longer than 512"):
        await client.completions.create(model=MODEL, prompt="abc", max_tokens=2)
    assert len(factory.engines["p1"].prefills) + len(factory.engines["p2"].prefills) == 1


async def test_decode_failure_after_streaming_started_ends_with_an_error_event(client, factory, rt):
    factory.engines["d1"].fail_decode_after = 2
    stream = await client.completions.create(model=MODEL, prompt="abc", max_tokens=8, stream=True)
    received = []
    with pytest.raises(openai.APIError, match="rank 0 died"):
        async for chunk in stream:
            received.append(chunk.choices[0].text)
    assert received == [" w0", " w1", " w2"]
    outcome = sample(
        rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome="decode_failed"
    )
    assert outcome == 1


async def test_a_truncated_decode_stream_is_an_error_not_a_short_answer(client, factory):
    factory.engines["d1"].truncate_after = 1
    with pytest.raises(openai.APIStatusError, match="without a finish reason") as caught:
        await client.completions.create(model=MODEL, prompt="abc", max_tokens=8)
    assert caught.value.status_code == 502


async def test_a_failed_non_streaming_request_is_counted_once(client, factory, rt):
    factory.engines["d1"].truncate_after = 1
    with pytest.raises(openai.APIStatusError):
        await client.completions.create(model=MODEL, prompt="abc", max_tokens=8)
    endpoint = "/v1/completions"
    outcome = "decode_truncated"
    assert sample(rt, "pdserve_router_requests_total", endpoint=endpoint, outcome=outcome) == 1
    assert sample(rt, "pdserve_router_e2e_latency_seconds_count", endpoint=endpoint) == 1


async def test_decode_refusing_the_handle_is_an_error_and_the_held_kv_is_released(client, factory):
    factory.engines["d1"].decode_error = UnknownKVHandle("no such handle")
    with pytest.raises(openai.APIStatusError) as caught:
        await client.completions.create(model=MODEL, prompt="abc", max_tokens=4)
    assert caught.value.status_code == 502
    assert caught.value.body["code"] == "kv_handle_unknown"  # type: ignore[index]
    prefill = factory.engines["p1"] if factory.engines["p1"].prefills else factory.engines["p2"]
    await rt_background_settled()
    assert prefill.aborted == prefill.prefills


async def rt_background_settled() -> None:
    """Let the router's best-effort abort tasks run."""
    for _ in range(5):
        await asyncio.sleep(0)


@pytest.mark.parametrize(
    ("body", "status", "code", "param"),
    [
        ({"model": "nope", "prompt": "a"}, 404, "model_not_found", "model"),
        (
            {"model": MODEL, "prompt": "a", "use_beam_search": True},
            400,
            "unsupported_parameter",
            "use_beam_search",
        ),
        # The fakes are reference engines, whose detokenizer always skips special tokens.
        (
            {"model": MODEL, "prompt": "a", "skip_special_tokens": False},
            400,
            "unsupported_parameter",
            "skip_special_tokens",
        ),
        ({"model": MODEL, "prompt": "a", "temperature": -1}, 400, "invalid_request", "temperature"),
        ({"model": MODEL, "prompt": "a", "max_tokens": 0}, 400, "invalid_request", "max_tokens"),
        ({"model": MODEL, "prompt": ""}, 400, "invalid_request", "prompt"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "invalid_request", "prompt"),
        ({"model": MODEL, "prompt": ["a"] * 65}, 400, "unsupported_parameter", "prompt"),
        ({"prompt": "a"}, 400, "invalid_request", "model"),
        ({"model": MODEL, "prompt": "a", "stop": ["x"] * 17}, 400, "invalid_request", None),
    ],
)
async def test_bad_requests_get_the_openai_error_envelope(rt, body, status, code, param):
    async with http(rt) as transport:
        response = await transport.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == code
    assert error["param"] == param
    assert error["message"]


@pytest.mark.parametrize("nested", [False, True])
async def test_an_over_long_token_id_prompt_gets_the_error_envelope(rt, nested):
    token_ids = [1] * (MAX_PROMPT_TOKEN_IDS + 1)
    body = {"model": MODEL, "prompt": [token_ids] if nested else token_ids}
    async with http(rt) as transport:
        response = await transport.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "invalid_request"
    assert error["param"] == "prompt"
    assert str(MAX_PROMPT_TOKEN_IDS) in error["message"]


async def test_routing_and_parsing_errors_use_the_envelope_too(rt):
    async with http(rt) as transport:
        missing = await transport.get("/v1/nothing")
        wrong_method = await transport.get("/v1/completions")
        not_json = await transport.post(
            "/v1/completions", content=b"{nope", headers={"content-type": "application/json"}
        )
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    assert wrong_method.status_code == 405
    assert wrong_method.json()["error"]["code"] == "method_not_allowed"
    assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_json"


async def test_api_keys_are_required_when_configured(factory):
    rt = prepared(factory, ("both", EngineRole.BOTH), api_keys=["secret-1", "secret-2"])
    async with http(rt) as transport:
        good = openai.AsyncOpenAI(
            base_url="http://router/v1", api_key="secret-2", http_client=transport, max_retries=0
        )
        bad = openai.AsyncOpenAI(
            base_url="http://router/v1", api_key="wrong", http_client=transport, max_retries=0
        )
        completion = await good.completions.create(model=MODEL, prompt="a", max_tokens=1)
        assert completion.choices[0].text
        with pytest.raises(openai.AuthenticationError):
            await bad.completions.create(model=MODEL, prompt="a", max_tokens=1)
        missing = await transport.get("/v1/models")
        assert missing.status_code == 401
        assert missing.json()["error"]["code"] == "missing_api_key"
        assert (await transport.get("/health")).status_code == 200


async def test_generation_routes_check_the_key_then_the_body_as_fastapi_did(factory):
    """The generation endpoints skip FastAPI's dependency solving (DirectRoute): the key is
    still checked first, and bodies are refused with the same codes and params."""
    keyed = prepared(factory, ("both", EngineRole.BOTH), api_keys=["k"])
    async with http(keyed) as transport:
        for path in ("/v1/completions", "/v1/chat/completions"):
            unkeyed = await transport.post(path, content=b"{nope")
            assert unkeyed.status_code == 401
            assert unkeyed.json()["error"]["code"] == "missing_api_key"
    rt = prepared(FakeFactory(), ("both", EngineRole.BOTH))
    good = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    async with http(rt) as transport:

        async def post(content: bytes, content_type: str | None = "application/json") -> dict:
            headers = {"content-type": content_type} if content_type else {}
            response = await transport.post("/v1/completions", content=content, headers=headers)
            assert response.status_code == 400, response.text
            return response.json()["error"]

        assert (await post(b""))["message"] == "missing required parameter None"
        assert (await post(b"[1]"))["code"] == "invalid_json"
        assert (await post(json.dumps(good).encode(), "text/plain"))["code"] == "invalid_json"
        extra = await transport.post("/v1/completions", json={**good, "bogus": 1})
        assert extra.status_code == 200, extra.text  # ignored, as vLLM's server does
        negative = await post(json.dumps({**good, "max_tokens": -1}).encode())
        assert negative["param"] == "max_tokens"
        missing = await post(json.dumps({"prompt": "hi"}).encode())
        assert missing["message"] == "missing required parameter 'model'"
        ok = await transport.post(
            "/v1/completions",
            content=json.dumps(good),
            headers={"content-type": "application/json; charset=utf-8"},
        )
        assert ok.status_code == 200
        assert ok.json()["choices"][0]["text"] == " w0 w1"


async def test_health_needs_a_ready_pair_and_models_lists_ready_models(factory):
    rt = prepared(factory, ("d1", EngineRole.DECODE))
    async with http(rt) as transport:
        not_ready = await transport.get("/health")
        assert not_ready.status_code == 503
        assert not_ready.json()["error"]["code"] == "not_ready"
        rt.pool.update("p1", view("p1", EngineRole.PREFILL))
        assert (await transport.get("/health")).status_code == 200
        listed = await transport.get("/v1/models")
        assert [m["id"] for m in listed.json()["data"]] == [MODEL]
        assert listed.json()["data"][0]["max_model_len"] is None  # no engine reported one
        # As vLLM's server lists it; the smallest of the model's READY engines.
        rt.pool.update("p1", view("p1", EngineRole.PREFILL, max_model_len=2048))
        rt.pool.update("d1", view("d1", EngineRole.DECODE, max_model_len=1024))
        listed = await transport.get("/v1/models")
    assert listed.json()["data"][0]["max_model_len"] == 1024


async def test_max_tokens_one_finishes_at_the_prefill(client, factory):
    completion = await client.completions.create(model=MODEL, prompt="abc", max_tokens=1)
    assert completion.choices[0].text == " w0"
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
