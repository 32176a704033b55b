"""Fields vLLM's server ignores are ignored by the router too: answered 200, counted in
``pdserve_router_ignored_fields_total{field}``, each name logged once."""

from __future__ import annotations

import logging

import pytest

from services.control_plane.wire import EngineRole
from tests.unit.router.fakes import MODEL, FakeFactory, http, prepared, sample

IGNORED = "pdserve_router_ignored_fields_total"


async def test_unknown_fields_are_ignored_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    rt = prepared(FakeFactory(), ("p0", EngineRole.PREFILL), ("d0", EngineRole.DECODE))
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "best_of": 1, "no_such_field": 3}
    with caplog.at_level(logging.WARNING, logger="services.router.frontend.vllm.ignored_fields"):
        async with http(rt) as client:
            for _ in range(2):
                answer = await client.post("/v1/completions", json=body)
                assert answer.status_code == 200, answer.text
            chat = await client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL,
                    "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 2,
                    "guided_json": {"type": "object"},  # removed in vLLM 0.32: ignored
                },
            )
            assert chat.status_code == 200, chat.text
            plain = await client.post(
                "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}
            )
            assert plain.status_code == 200, plain.text
    assert sample(rt, IGNORED, field="no_such_field") == 2
    assert sample(rt, IGNORED, field="guided_json") == 1
    assert sample(rt, IGNORED, field="best_of") == 2  # removed from vLLM's protocol
    assert sample(rt, IGNORED, field="max_tokens") == 0  # a field it knows
    logged = [r.getMessage() for r in caplog.records if "ignored" in r.getMessage()]
    assert len([m for m in logged if "no_such_field" in m]) == 1, logged
    # vLLM's own DEBUG record of the fields is not let through
    assert not [r for r in caplog.records if r.levelno < logging.INFO], caplog.records


async def test_a_clients_kv_transfer_params_are_ignored_and_counted_not_refused() -> None:
    """vLLM's PD connectors' hand-off field: pdserve makes its own hand-off and never follows
    a client's (tests/security/test_ssrf.py), so it is answered 200 and counted."""
    rt = prepared(FakeFactory(), ("p0", EngineRole.PREFILL), ("d0", EngineRole.DECODE))
    handoff = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": 1}
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "kv_transfer_params": handoff}
    async with http(rt) as client:
        answer = await client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text
        own = await client.post(
            "/v1/completions", json={**body, "vllm_xargs": {"mine": 1}}
        )  # an argument for the engine's own logits processors: pdserve's engines lack them
        assert own.status_code == 400, own.text
        assert own.json()["error"]["param"] == "vllm_xargs"
    assert sample(rt, IGNORED, field="kv_transfer_params") == 2
