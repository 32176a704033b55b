"""Hostile HTTP bodies on a real router (uvicorn, stub engines): 4xx answers, never a 5xx.

Complements the schema fuzzing (``tests/unit/router/frontend/vllm/test_schema_fuzz.py``,
generated from the OpenAPI spec) with inputs a schema does not generate: bodies that are not
JSON, not UTF-8, nested 100k levels deep, megabytes long, of the wrong content type, with
extreme numbers, duplicate keys, NaN, on both generation endpoints (each hostile field in a
body that is valid otherwise). The router serves vLLM's OpenAI front end: every answer is
vLLM's error envelope ``{"error": {"message", "type", "param", "code"}}`` with ``code`` its
HTTP status, except where vLLM's server answers FastAPI's plain ``{"detail": ...}``
(:data:`PLAIN_ANSWERS`: a body nested past Python's recursion limit, unknown routes and
methods). After all of them the router still serves a normal request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.stub import StubBackend
from services.router.config import RouterSettings
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

COMPLETION = {"model": "stub", "prompt": [1, 2, 3], "max_tokens": 2}
CHAT = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
DEEP = b"[" * 100_000 + b"]" * 100_000
PLAIN_ANSWERS = {DEEP: (400, {"detail": "There was an error parsing the body"})}
"""vLLM's server's answers that are not its error envelope: FastAPI's own, for a body its JSON
parser cannot read (recursion), which reaches no vLLM handler."""
ENVELOPE = {"message", "type", "param", "code"}
BODY_LIMIT = 4 * 2**20


def _raw_bodies(good: dict[str, Any]) -> list[tuple[str, bytes]]:
    """(content type, body) pairs for the endpoint whose valid request is ``good``."""

    def body(**update: object) -> bytes:
        return json.dumps({**good, **update}).encode()

    def appended(raw: str) -> bytes:  # ``good`` with more members, as raw JSON text
        return body()[:-1] + b", " + raw.encode() + b"}"

    cases = [
        ("application/json", b""),
        ("application/json", b"{"),
        ("application/json", b"\xff\xfe\x00garbage"),
        ("application/json", DEEP),
        ("application/json", b"null"),
        ("application/json", b"[1, 2, 3]"),
        ("text/plain", body()),
        ("application/x-www-form-urlencoded", b"model=stub&prompt=hi"),
        ("application/json", body(max_tokens=2**63)),
        ("application/json", body(max_tokens=-1)),
        ("application/json", body(temperature=1e308, top_p=-3)),
        ("application/json", body(seed=2**70)),
        ("application/json", body(stop=["x"] * 10_000)),
        ("application/json", body(model="\u0000\ud7ff" * 100)),
        ("application/json", body(stream="yes", n=5, logprobs=3)),
        ("application/json", appended('"model": "other"')),  # a duplicate key: the last wins
        ("application/json", appended('"max_tokens": NaN')),
        ("application/json", appended(f'"user": "{"u" * BODY_LIMIT}"')),  # past the body limit
    ]
    if "prompt" in good:
        cases += [
            ("application/json", body(prompt=[-1, 2])),
            ("application/json", body(prompt=[2**40])),
            ("application/json", body(prompt=[])),
            ("application/json", body(prompt="")),
            ("application/json", body(prompt="a" * 3_000_000)),
        ]
    else:
        cases += [
            ("application/json", body(messages=[])),
            ("application/json", body(messages="hi")),
            ("application/json", body(messages=[{"role": "user", "content": None}])),
            ("application/json", body(messages=[{"role": "user", "content": [{"type": "x"}]}])),
            ("application/json", body(messages=[{"role": "user", "content": "a" * 3_000_000}])),
        ]
    return cases


@pytest.fixture
async def router_url(
    cp_settings: ControlPlaneSettings, stub_checkpoint: Path
) -> AsyncIterator[str]:
    engine_settings = service_settings(cp_settings)
    router = RouterSettings(
        control_plane=cp_settings, tokenizer=stub_checkpoint, served_model_name="stub"
    )
    assert router.max_request_body_bytes == BODY_LIMIT
    async with (
        hosted(engine_settings, StubBackend(), engine_id="prefill-x", role=EngineRole.PREFILL),
        hosted(engine_settings, StubBackend(), engine_id="decode-x", role=EngineRole.DECODE),
        serving_router(router) as url,
    ):
        yield url


async def test_hostile_bodies_get_4xx_error_answers_and_the_router_keeps_serving(
    router_url: str,
) -> None:
    async with httpx.AsyncClient(base_url=router_url, timeout=60) as client:
        statuses: list[int] = []
        for path, good in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            ok = await client.post(path, json=good)
            assert ok.status_code == 200, ok.text  # each hostile body differs from a valid one
            for content_type, raw in _raw_bodies(good):
                response = await client.post(
                    path, content=raw, headers={"Content-Type": content_type}
                )
                statuses.append(response.status_code)
                where = (path, raw[:60], response.text[:300])
                assert 400 <= response.status_code < 500, where
                if raw in PLAIN_ANSWERS:
                    assert (response.status_code, response.json()) == PLAIN_ANSWERS[raw], where
                    continue
                error = response.json()["error"]
                assert set(error) == ENVELOPE, where
                assert error["code"] == response.status_code, where
                assert isinstance(error["message"], str) and error["message"], where
        assert len(statuses) == 2 * len(_raw_bodies(COMPLETION))
        assert statuses.count(413) == 2  # the body past the limit, on each endpoint
        # Unknown routes and methods: FastAPI's answers in vLLM's server, not its envelope.
        for method, path, status, detail in (
            ("PUT", "/v1/completions", 405, "Method Not Allowed"),
            ("GET", "/v1/nothing", 404, "Not Found"),
            ("GET", "/..%2f", 404, "Not Found"),
        ):
            response = await client.request(method, path)
            assert (response.status_code, response.json()) == (status, {"detail": detail})
        for path, good in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
            ok = await client.post(path, json=good)
            assert ok.status_code == 200, ok.text
            assert ok.json()["usage"]["completion_tokens"] == 2
