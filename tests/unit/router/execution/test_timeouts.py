"""The router's bounds on engine calls, over fake engines that stall without dying.

A stalled engine is reachable and heartbeating but sends nothing (a stopped rank): the router
must end the request with ``engine_timeout`` within its bound, abort it on the engine, and count
which bound tripped (``pdserve_router_engine_timeouts_total{call, bound}``). The same against
real processes (SIGSTOPped ranks) is in tests/e2e/test_faults_reference.py.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pydantic
import pytest

from services.control_plane.wire import EngineRole
from services.engines.errors import EngineStalled
from services.engines.requests import DecodeRequest, TokenDelta
from services.router.config import RouterSettings
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import (
    MODEL,
    FakeEngine,
    FakeFactory,
    http,
    outcomes,
    prepared,
    sample,
    text_of,
)

IDLE_S = 0.2
"""The idle bound these tests configure: short, so a tripped bound costs little."""
HANG_S = 60.0
"""A request still running after this has hung: the bound did not trip."""


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


def disaggregated(factory: FakeFactory, **settings: object) -> RouterRuntime:
    return prepared(
        factory,
        ("p1", EngineRole.PREFILL),
        ("p2", EngineRole.PREFILL),
        ("d1", EngineRole.DECODE),
        **settings,
    )


async def post(rt: RouterRuntime, path: str, body: dict[str, object]) -> httpx.Response:
    """POST to the router in-process; a request still running after ``HANG_S`` fails the test
    (httpx's ASGI transport has no timeout of its own)."""
    async with http(rt) as client:
        return await asyncio.wait_for(client.post(path, json=body), HANG_S)


def sse_events(body: str) -> list[str]:
    return [event.removeprefix("data: ") for event in body.split("\n\n") if event]


def timeouts(rt: RouterRuntime, call: str, bound: str) -> float:
    return sample(rt, "pdserve_router_engine_timeouts_total", call=call, bound=bound)


async def test_a_decode_stream_stalled_mid_way_ends_with_an_error_event_and_is_aborted(
    factory: FakeFactory,
) -> None:
    rt = disaggregated(factory, decode_idle_timeout_s=IDLE_S)
    decode = factory.engines["d1"]
    decode.stall_decode_after = 2
    async with http(rt) as client:  # (timed once the app is up)
        started = time.monotonic()
        response = await asyncio.wait_for(
            client.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": "abc", "max_tokens": 8, "stream": True},
            ),
            HANG_S,
        )
        elapsed = time.monotonic() - started
    await rt.executor.close()  # the best-effort aborts have run
    assert response.status_code == 200
    events = sse_events(response.text)
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2]]
    assert "".join(texts) == text_of(7, 101, 102)  # the prefill's token, then two decode deltas
    error = json.loads(events[-2])["error"]
    assert error["code"] == 504  # vLLM's error event: the code is the HTTP status
    assert "decode_idle_timeout_s=0.2" in error["message"]
    assert "next token" in error["message"]
    assert events[-1] == "[DONE]"
    assert IDLE_S <= elapsed < HANG_S
    request_id = decode.decodes[-1].request_id
    assert decode.stalled_calls_closed == [request_id]  # the stream was closed (call cancelled)
    assert decode.aborted == [request_id]  # and the engine was sent an Abort
    assert timeouts(rt, "decode", "idle") == 1
    assert timeouts(rt, "decode", "deadline") == 0
    assert sample(rt, "pdserve_router_aborts_total", role="decode", outcome="found") == 1
    outcome = sample(
        rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome="engine_timeout"
    )
    assert outcome == 1
    # The decode engine had started (pulled the KV): the producer is not asked to release it.
    assert not factory.engines["p1"].aborted and not factory.engines["p2"].aborted


async def test_a_local_decode_that_never_starts_is_a_504_before_the_first_byte(
    factory: FakeFactory,
) -> None:
    rt = prepared(factory, ("d1", EngineRole.DECODE), colocated=True, decode_idle_timeout_s=IDLE_S)
    decode = factory.engines["d1"]
    decode.stall_decode_after = 0
    response = await post(
        rt,
        "/v1/chat/completions",
        body={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True},
    )
    await rt.executor.close()
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == 504
    assert "sent no first token" in error["message"]
    assert decode.aborted == [decode.decodes[-1].request_id]
    assert timeouts(rt, "decode", "idle") == 1
    assert outcomes(rt, "/v1/chat/completions") == {"engine_timeout": 1}


async def test_a_stalled_first_decode_delta_releases_the_kv_the_prefill_engine_holds(
    factory: FakeFactory,
) -> None:
    rt = disaggregated(factory, decode_idle_timeout_s=IDLE_S)
    factory.engines["d1"].stall_decode_after = 0
    response = await post(
        rt, "/v1/completions", body={"model": MODEL, "prompt": "abc", "max_tokens": 4}
    )
    await rt.executor.close()
    assert response.status_code == 504, response.text
    assert "sent no token within decode_idle_timeout_s=0.2" in response.json()["error"]["message"]
    assert outcomes(rt) == {"engine_timeout": 1}
    prefill = factory.engines["p1"] if factory.engines["p1"].prefills else factory.engines["p2"]
    assert prefill.aborted == prefill.prefills  # the handle the decode never used
    assert factory.engines["d1"].aborted == prefill.prefills
    assert sample(rt, "pdserve_router_aborts_total", role="prefill", outcome="found") == 1
    assert sample(rt, "pdserve_router_aborts_total", role="decode", outcome="found") == 1


async def test_a_slow_but_live_stream_ends_at_the_whole_stream_deadline(
    factory: FakeFactory,
) -> None:
    rt = disaggregated(factory, decode_timeout_s=0.3, decode_idle_timeout_s=HANG_S)
    factory.engines["d1"].delta_delay_s = 0.05  # never idle for long, but 100 tokens take 5 s
    response = await post(
        rt,
        "/v1/completions",
        body={"model": MODEL, "prompt": "abc", "max_tokens": 100, "stream": True},
    )
    await rt.executor.close()
    assert response.status_code == 200, response.text
    error = json.loads(sse_events(response.text)[-2])["error"]
    assert error["code"] == 504
    assert "did not finish within decode_timeout_s=0.3" in error["message"]
    assert outcomes(rt) == {"engine_timeout": 1}
    assert timeouts(rt, "decode", "deadline") == 1
    assert timeouts(rt, "decode", "idle") == 0


async def test_stalled_prefill_engines_time_out_are_aborted_and_the_request_runs_locally(
    factory: FakeFactory,
) -> None:
    rt = disaggregated(factory, prefill_timeout_s=IDLE_S)
    for engine_id in ("p1", "p2"):
        factory.engines[engine_id].stall_prefill = True
    response = await post(
        rt, "/v1/completions", body={"model": MODEL, "prompt": "abc", "max_tokens": 2}
    )
    await rt.executor.close()
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == text_of(100, 101)  # the decode engine's
    assert response.headers["x-pdserve-execution-path"] == "local"
    for engine_id in ("p1", "p2"):
        engine = factory.engines[engine_id]
        assert engine.stalled_calls_closed == engine.prefills == engine.aborted
        assert len(engine.prefills) == 1
    assert timeouts(rt, "prefill", "deadline") == 2
    assert (
        sample(rt, "pdserve_router_prefill_retries_total", phase="prefill", reason="engine_timeout")
        == 1
    )
    assert sample(rt, "pdserve_router_fallbacks_total", reason="prefill_failed") == 1


class StallsOnce(FakeEngine):
    """A decode engine that enforces the unary call's idle bound itself, as the gRPC
    ``DecodeOnce`` does: it answers ``EngineStalled`` (its request aborted there)."""

    async def decode_once(
        self, request: DecodeRequest, *, idle_timeout_s: float, timeout_s: float | None = None
    ) -> TokenDelta:
        self.once.append(request.request_id)
        self.idle_bounds.append(idle_timeout_s)
        raise EngineStalled(f"engine {self.engine_id} produced no next token within the bound")


async def test_a_non_streamed_decode_the_engine_reports_stalled_is_an_idle_timeout(
    factory: FakeFactory,
) -> None:
    """The engine's ``EngineStalled`` is the router's idle bound tripping: ``engine_timeout``
    (504 before the first byte), counted ``bound="idle"``, the request aborted on the engine."""
    factory.engines["d1"] = StallsOnce("d1")
    rt = disaggregated(factory, decode_idle_timeout_s=IDLE_S)
    response = await post(
        rt, "/v1/completions", body={"model": MODEL, "prompt": "abc", "max_tokens": 8}
    )
    await rt.executor.close()
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == 504
    assert "decode_idle_timeout_s=0.2" in error["message"]
    decode = factory.engines["d1"]
    assert decode.idle_bounds == [IDLE_S]  # the router's bound went to the engine
    assert decode.aborted == decode.once
    assert timeouts(rt, "decode", "idle") == 1
    assert timeouts(rt, "decode", "deadline") == 0
    outcome = sample(
        rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome="engine_timeout"
    )
    assert outcome == 1


async def test_a_non_streamed_decode_stalled_mid_way_is_an_idle_timeout_and_aborted(
    factory: FakeFactory,
) -> None:
    """The same through the connector's own bound (the seam's default ``decode_once``)."""
    rt = disaggregated(factory, decode_idle_timeout_s=IDLE_S)
    decode = factory.engines["d1"]
    decode.stall_decode_after = 2
    response = await post(
        rt, "/v1/completions", body={"model": MODEL, "prompt": "abc", "max_tokens": 8}
    )
    await rt.executor.close()
    assert response.status_code == 504, response.text
    assert "decode_idle_timeout_s=0.2" in response.json()["error"]["message"]
    assert outcomes(rt) == {"engine_timeout": 1}
    request_id = decode.decodes[-1].request_id
    assert decode.once == [request_id]
    assert decode.stalled_calls_closed == [request_id]
    assert decode.aborted == [request_id]
    assert timeouts(rt, "decode", "idle") == 1


async def test_a_slow_but_live_non_streamed_decode_ends_at_the_whole_call_deadline(
    factory: FakeFactory,
) -> None:
    rt = disaggregated(factory, decode_timeout_s=0.3, decode_idle_timeout_s=HANG_S)
    factory.engines["d1"].delta_delay_s = 0.05  # never idle for long, but 100 tokens take 5 s
    response = await post(
        rt, "/v1/completions", body={"model": MODEL, "prompt": "abc", "max_tokens": 100}
    )
    await rt.executor.close()
    assert response.status_code == 504, response.text
    error = response.json()["error"]
    assert error["code"] == 504
    assert "did not finish within decode_timeout_s=0.3" in error["message"]
    assert outcomes(rt) == {"engine_timeout": 1}
    assert timeouts(rt, "decode", "deadline") == 1
    assert timeouts(rt, "decode", "idle") == 0
    assert factory.engines["d1"].aborted == factory.engines["d1"].once


def test_the_idle_timeout_is_read_from_the_environment_and_must_be_positive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert RouterSettings().decode_idle_timeout_s == 60.0
    monkeypatch.setenv("PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S", "7.5")
    assert RouterSettings().decode_idle_timeout_s == 7.5
    for bad in ("0", "-1"):
        monkeypatch.setenv("PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S", bad)
        with pytest.raises(pydantic.ValidationError, match="decode_idle_timeout_s"):
            RouterSettings()
