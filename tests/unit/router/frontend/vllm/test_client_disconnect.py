"""A client that hangs up before its response started cancels the run on the engines.

The app is called as raw ASGI, so the test decides exactly when the client's
``http.disconnect`` arrives: while the prefill engine is still working (streaming), or while a
non-streaming answer is being generated. The same over real processes is in
tests/security/test_up_secured.py.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.control_plane.wire import EngineRole
from services.engines.requests import DecodeRequest, PrefillResult, SamplingParams, TokenDelta
from services.engines.trace_context import TraceContext
from services.router.main import create_app
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import (
    MODEL,
    FakeEngine,
    FakeFactory,
    post_then_hang_up,
    runtime,
    sample,
    text_of,
    view,
)

BOUND_S = 5.0


@dataclass
class SlowEngine(FakeEngine):
    """Prefill waits until cancelled; decode yields one token, then waits until cancelled."""

    started: asyncio.Event = field(default_factory=asyncio.Event)
    cancelled: list[str] = field(default_factory=list)

    async def prefill(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        timeout_s: float | None = None,
        trace: TraceContext | None = None,
        lora: object = None,
    ) -> PrefillResult:
        self.prefills.append(request_id)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(request_id)
            raise
        raise AssertionError("unreachable")

    async def decode(
        self,
        request: DecodeRequest,
        *,
        timeout_s: float | None = None,
    ) -> AsyncIterator[TokenDelta]:
        self.decodes.append(request)
        yield TokenDelta((100,), " w0", None)
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.cancelled.append(request.request_id)
            raise


class SlowFactory(FakeFactory):
    def connect(self, record: Any) -> FakeEngine:
        return self.engines.setdefault(record.engine_id, SlowEngine(record.engine_id))


def prepared(
    *engines: tuple[str, EngineRole], factory: FakeFactory | None = None
) -> tuple[RouterRuntime, FakeFactory]:
    factory = factory or SlowFactory()
    rt = runtime(factory)
    for engine_id, role in engines:
        rt.pool.update(engine_id, view(engine_id, role))
    rt.pool._synced.set()
    return rt, factory


async def call_then_hang_up(
    rt: RouterRuntime, body: dict[str, Any], engine: SlowEngine
) -> list[dict[str, Any]]:
    """POST ``body`` to /v1/completions; the client disconnects once ``engine`` is busy."""
    app = create_app(rt.settings, runtime=rt)
    return await post_then_hang_up(app, body, engine.started, bound_s=BOUND_S, lifespan=True)


def disconnects(rt: RouterRuntime) -> float:
    return sample(
        rt,
        "pdserve_router_requests_total",
        endpoint="/v1/completions",
        outcome="client_disconnected",
    )


async def test_hanging_up_during_the_prefill_cancels_it_and_never_starts_a_decode() -> None:
    rt, factory = prepared(("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))
    prefill = factory.engines["p1"]
    assert isinstance(prefill, SlowEngine)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8, "stream": True}

    sent = await call_then_hang_up(rt, body, prefill)

    assert prefill.cancelled == prefill.prefills and len(prefill.prefills) == 1
    assert not factory.engines["d1"].decodes
    assert disconnects(rt) == 1
    # The response start waits for the run's engines (the x-pdserve-* headers): the client
    # left before, so nothing was sent.
    assert sent == []


async def test_hanging_up_on_a_non_streaming_request_cancels_the_decode() -> None:
    # No prefill engine: the decode engine generates everything (a counted local fallback).
    rt, factory = prepared(("d1", EngineRole.DECODE))
    decode = factory.engines["d1"]
    assert isinstance(decode, SlowEngine)
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 8}

    sent = await call_then_hang_up(rt, body, decode)

    assert decode.cancelled == [request.request_id for request in decode.decodes]
    assert len(decode.cancelled) == 1
    assert disconnects(rt) == 1
    # vLLM's front end answers a request whose client left with nothing (a 200 of ``null``;
    # recorded only: nobody is there to read it).
    assert sent[0]["status"] == 200
    assert b"".join(m.get("body", b"") for m in sent[1:]) == b"null"


async def test_a_client_that_stays_gets_its_answer() -> None:
    """Control: the same app and ASGI harness, with a disconnect that never comes."""
    rt, _ = prepared(("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE), factory=FakeFactory())
    never = SlowEngine("never-busy")  # its ``started`` is never set: no disconnect
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3}

    sent = await call_then_hang_up(rt, body, never)

    assert sent[0]["status"] == 200
    answer = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert answer["choices"][0]["text"] == text_of(7, 101, 102)  # the prefill's token, 2 more
    assert disconnects(rt) == 0
