"""Hostile HTTP bodies on a real router (uvicorn, stub engines): 4xx envelopes, never a 5xx.

Complements the schema fuzzing (``tests/unit/router/test_schema_fuzz.py``, generated from the
OpenAPI spec) with inputs a schema does not generate: bodies that are not JSON, not UTF-8,
nested 100k levels deep, megabytes long, of the wrong content type, with extreme numbers. After
all of them the router still serves a normal request.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.stub import StubBackend
from services.router.config import RouterSettings
from tests.integration.services.conftest import hosted, service_settings
from tests.security.router_harness import serving_router

pytestmark = pytest.mark.integration

GOOD = {"model": "stub", "prompt": [1, 2, 3], "max_tokens": 2}


def _raw_bodies() -> list[tuple[str, bytes]]:
    def body(**update: object) -> bytes:
        return json.dumps({**GOOD, **update}).encode()

    return [
        ("application/json", b""),
        ("application/json", b"{"),
        ("application/json", b"\xff\xfe\x00garbage"),
        ("application/json", b"[" * 100_000 + b"]" * 100_000),
        ("application/json", b'{"model": "stub", "prompt": "' + b"a" * 3_000_000 + b'"}'),
        ("application/json", b"null"),
        ("application/json", b"[1, 2, 3]"),
        ("text/plain", body()),
        ("application/x-www-form-urlencoded", b"model=stub&prompt=hi"),
        ("application/json", body(max_tokens=2**63)),
        ("application/json", body(max_tokens=-1)),
        ("application/json", body(prompt=[-1, 2])),
        ("application/json", body(prompt=[2**40])),
        ("application/json", body(prompt=[])),
        ("application/json", body(prompt="")),
        ("application/json", body(temperature=1e308, top_p=-3)),
        ("application/json", body(seed=2**70)),
        ("application/json", body(stop=["x"] * 10_000)),
        ("application/json", body(model="\u0000\ud7ff" * 100)),
        ("application/json", body(stream="yes", n=5, logprobs=3)),
        ("application/json", b'{"model": "stub", "model": "other", "prompt": [1]}'),
        ("application/json", b'{"model": "stub", "prompt": [1], "max_tokens": NaN}'),
    ]


@pytest.fixture
async def router_url(cp_settings: ControlPlaneSettings) -> AsyncIterator[str]:
    engine_settings = service_settings(cp_settings)
    async with (
        hosted(engine_settings, StubBackend(), engine_id="prefill-x", role=EngineRole.PREFILL),
        hosted(engine_settings, StubBackend(), engine_id="decode-x", role=EngineRole.DECODE),
        serving_router(RouterSettings(control_plane=cp_settings)) as url,
    ):
        yield url


async def test_hostile_bodies_get_openai_4xx_envelopes_and_the_router_keeps_serving(
    router_url: str,
) -> None:
    async with httpx.AsyncClient(base_url=router_url, timeout=60) as client:
        statuses = []
        for path in ("/v1/completions", "/v1/chat/completions"):
            for content_type, raw in _raw_bodies():
                response = await client.post(
                    path, content=raw, headers={"Content-Type": content_type}
                )
                statuses.append(response.status_code)
                assert 400 <= response.status_code < 500, (path, raw[:60], response.text[:300])
                error = response.json()["error"]
                assert set(error) == {"message", "type", "param", "code"}
        assert len(statuses) == 2 * len(_raw_bodies())
        for method, path in (("PUT", "/v1/completions"), ("GET", "/v1/nothing"), ("GET", "/..%2f")):
            response = await client.request(method, path)
            assert response.status_code in (404, 405), (method, path, response.status_code)
            assert set(response.json()["error"]) == {"message", "type", "param", "code"}
        ok = await client.post("/v1/completions", json=GOOD)
        assert ok.status_code == 200, ok.text
