"""``HotPathApp``: the generation POSTs dispatched without Starlette's middleware stack answer
exactly as through it (status, envelope, auth header, counted outcome)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from services.control_plane.wire import EngineRole
from services.engines.errors import EngineOverloaded, InvalidRequest
from services.router.frontend.hot_path import HotPathApp
from services.router.main import create_app
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import FakeFactory, prepared, sample

MODEL = "tiny"
GOOD = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def _runtime(**settings: Any) -> tuple[FakeFactory, RouterRuntime]:
    factory = FakeFactory()
    rt = prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE), **settings)
    return factory, rt


def _client(rt: RouterRuntime, *, direct: bool) -> httpx.AsyncClient:
    app = create_app(rt.settings, runtime=rt)
    assert isinstance(app, HotPathApp)
    if not direct:
        app._direct = {}  # every request through FastAPI's own stack, as before the hot path
    # Starlette re-raises an unexpected error after its 500 (uvicorn logs it); the client
    # sees the 500 either way.
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://router")


def test_the_generation_posts_are_the_direct_paths() -> None:
    _, rt = _runtime()
    app = create_app(rt.settings, runtime=rt)
    assert isinstance(app, HotPathApp)
    assert app.direct_paths == {"/v1/completions", "/v1/chat/completions"}


CASES: list[tuple[str, str, bytes, dict[str, str]]] = [
    ("ok", "/v1/completions", json.dumps(GOOD).encode(), {}),
    ("ok chat", "/v1/chat/completions", json.dumps(CHAT).encode(), {}),
    ("no body", "/v1/completions", b"", {}),
    ("not json", "/v1/completions", b"{nope", {}),
    ("not an object", "/v1/chat/completions", b"[1]", {}),
    ("text/plain", "/v1/completions", json.dumps(GOOD).encode(), {"content-type": "text/plain"}),
    ("extra field", "/v1/completions", json.dumps({**GOOD, "bogus": 1}).encode(), {}),
    ("unsupported", "/v1/completions", json.dumps({**GOOD, "use_beam_search": True}).encode(), {}),
    ("bad value", "/v1/completions", json.dumps({**GOOD, "max_tokens": -1}).encode(), {}),
    ("unknown model", "/v1/completions", json.dumps({**GOOD, "model": "other"}).encode(), {}),
    ("trailing slash", "/v1/completions/", json.dumps(GOOD).encode(), {}),
]


async def _answers(
    rt: RouterRuntime, direct: bool, cases: list[tuple[str, str, bytes, dict[str, str]]]
) -> list[tuple[str, int, Any, str | None]]:
    answers = []
    async with _client(rt, direct=direct) as client:
        for name, path, body, headers in cases:
            response = await client.post(
                path, content=body, headers={"content-type": "application/json", **headers}
            )
            if response.headers.get("content-type") != "application/json":
                shown: Any = (response.text, response.headers.get("location"))
            else:
                payload = response.json()
                shown = payload["error"] if "error" in payload else sorted(payload)
            answers.append(
                (name, response.status_code, shown, response.headers.get("www-authenticate"))
            )
    return answers


async def test_requests_and_errors_answer_as_through_the_stack() -> None:
    _, stacked_rt = _runtime()
    _, direct_rt = _runtime()
    stacked = await _answers(stacked_rt, False, CASES)
    direct = await _answers(direct_rt, True, CASES)
    assert direct == stacked
    assert [status for _, status, _, _ in direct][:2] == [200, 200]
    for outcome in ("ok", "invalid_json", "unsupported_parameter", "invalid_request"):
        counted = sample(
            direct_rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome=outcome
        )
        assert counted == sample(
            stacked_rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome=outcome
        )
        assert counted >= 1, outcome


@pytest.mark.parametrize("direct", [False, True])
async def test_keys_engine_errors_and_bugs_keep_their_envelopes(direct: bool) -> None:
    factory, rt = _runtime(api_keys=["k"])
    factory.engines["p1"].prefill_error = InvalidRequest("the engine says no")
    async with _client(rt, direct=direct) as client:
        missing = await client.post("/v1/completions", json=GOOD)
        assert missing.status_code == 401
        assert missing.headers["www-authenticate"] == "Bearer"
        assert missing.json()["error"]["code"] == "missing_api_key"
        keyed = {"authorization": "Bearer k"}
        refused = await client.post("/v1/completions", json=GOOD, headers=keyed)
        assert refused.status_code == 400
        assert "the engine says no" in refused.json()["error"]["message"]
        factory.engines["p1"].prefill_error = EngineOverloaded("full")
        # local fallback after the only prefill engine failed: still an answer
        fallback = await client.post("/v1/completions", json=GOOD, headers=keyed)
        assert fallback.status_code == 200
        assert fallback.headers["x-pdserve-execution-path"] == "local"

        def broken(*args: object, **kwargs: object) -> list[int]:
            raise RuntimeError("a bug")

        rt.chat.tokenize = broken  # type: ignore[method-assign]
        bug = await client.post("/v1/chat/completions", json=CHAT, headers=keyed)
    assert bug.status_code == 500
    assert bug.json()["error"]["message"] == "internal error"
    assert sample(rt, "pdserve_router_fallbacks_total", reason="prefill_failed") == 1
    assert (
        sample(
            rt,
            "pdserve_router_requests_total",
            endpoint="/v1/chat/completions",
            outcome="internal_error",
        )
        == 1
    )


async def test_a_body_sent_in_pieces_is_read_whole() -> None:
    """A chunked upload arrives as several ASGI messages; the direct path joins them."""
    _, rt = _runtime()
    whole = json.dumps(GOOD).encode()

    async def pieces() -> Any:
        for start in range(0, len(whole), 7):
            yield whole[start : start + 7]

    headers = {"content-type": "application/json"}
    async with _client(rt, direct=True) as client:
        split = await client.post("/v1/completions", content=pieces(), headers=headers)
        at_once = await client.post("/v1/completions", content=whole, headers=headers)
    assert split.status_code == 200, split.text
    assert split.json()["choices"] == at_once.json()["choices"]
    assert split.headers["content-type"] == "application/json"
    assert split.headers["content-length"] == str(len(split.content))
