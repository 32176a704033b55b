"""Prefill failover after the decode engine found the producer gone, decode migration, and the
circuit breaker, against scripted fake engines (tests/e2e/test_failover_reference.py runs the
real processes)."""

from __future__ import annotations

import httpx
import openai
import pytest

from services.bench.sse import json_events
from services.control_plane.wire import EngineRole
from services.engines.errors import EngineFailed, RequestAborted
from services.router.runtime import RouterRuntime
from services.router.scheduling.health import CircuitBreaker, CircuitState
from services.serving.errors import EngineUnreachable
from tests.unit.router.fakes import (
    MODEL,
    BlamesProducer,
    FailsFirstLegs,
    FakeEngine,
    FakeFactory,
    http,
    outcomes,
    prepared,
    sample,
    text_of,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_breaker_opens_at_once_probes_after_the_backoff_and_doubles_it() -> None:
    clock = Clock()
    breaker = CircuitBreaker(backoff_s=5, max_backoff_s=12, probe_lease_s=30, clock=clock)
    assert breaker.available() and breaker.state is CircuitState.CLOSED
    assert breaker.failure() is True  # a trip
    assert not breaker.available() and breaker.retry_in_s == 5
    clock.now += 5
    assert breaker.available()
    breaker.begin_call()  # the probe
    assert breaker.state is CircuitState.HALF_OPEN and not breaker.available()
    assert breaker.failure() is False  # not a new trip, but the back-off doubles
    assert breaker.retry_in_s == 10
    clock.now += 10
    breaker.begin_call()
    breaker.failure()
    assert breaker.retry_in_s == 12  # capped
    clock.now += 12
    breaker.begin_call()
    breaker.success()
    assert breaker.state is CircuitState.CLOSED and breaker.available()
    breaker.failure()
    assert breaker.retry_in_s == 5  # reset by the success
    assert breaker.trips == 2


def test_a_probe_that_never_reports_stops_blocking_after_its_lease() -> None:
    clock = Clock()
    breaker = CircuitBreaker(backoff_s=1, probe_lease_s=3, clock=clock)
    breaker.failure()
    clock.now += 1
    breaker.begin_call()
    assert not breaker.available()
    clock.now += 3
    assert breaker.available()


async def completion(rt: RouterRuntime, **body: object) -> httpx.Response:
    async with http(rt) as transport:
        return await transport.post(
            "http://router/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "temperature": 0, **body},
        )


async def three_past_p1(factory: FakeFactory) -> RouterRuntime:
    """Prefill engines p1 and p2, decode engine d1; three completions of 4 tokens each answered
    in full whatever p1 does (whichever prefill engine comes first, p1 is tried)."""
    rt = prepared(
        factory,
        ("p1", EngineRole.PREFILL),
        ("p2", EngineRole.PREFILL),
        ("d1", EngineRole.DECODE),
    )
    for _ in range(3):
        reply = await completion(rt, max_tokens=4)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 4
        assert body["choices"][0]["finish_reason"] == "length"
    assert factory.engines["p1"].prefills, "p1 was never tried"
    return rt


async def test_a_pull_from_a_dead_producer_is_prefilled_again_elsewhere(
    factory: FakeFactory,
) -> None:
    factory.engines["d1"] = BlamesProducer("d1")
    rt = await three_past_p1(factory)
    retries = sample(
        rt, "pdserve_router_prefill_retries_total", phase="kv_pull", reason="kv_transfer_failed"
    )
    assert retries >= 1
    # The continuation carried the first token in its prompt and asked for the rest.
    continued = [d for d in factory.engines["d1"].decodes if d.request_id.endswith(".m1")]
    assert continued and all(d.sampling.max_tokens == 3 for d in continued)
    assert all(d.sampling.output_tokens_in_prompt == 1 for d in continued)  # output, not prompt
    assert all(d.prompt_token_ids[-1] == 7 for d in continued)  # the prefill's first token
    assert sample(rt, "pdserve_router_migrations_total", reason="kv_transfer_failed") == 0


async def test_a_prefill_its_engine_aborted_is_prefilled_again_elsewhere(
    factory: FakeFactory,
) -> None:
    # A host ending on a rank's death aborts its prefills (CANCELLED): the client is still
    # there, so another prefill engine runs it (seen once under load in CI as a lost request).
    factory.engines["p1"] = FakeEngine("p1", prefill_error=RequestAborted("host ending"))
    rt = await three_past_p1(factory)
    retried = sample(
        rt, "pdserve_router_prefill_retries_total", phase="prefill", reason="request_cancelled"
    )
    assert retried == len(factory.engines["p1"].prefills)


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


@pytest.mark.parametrize("stream", [True, False])
async def test_a_decode_engine_dying_mid_stream_is_migrated_without_the_client_noticing(
    factory: FakeFactory, stream: bool
) -> None:
    factory.engines["d1"] = FailsFirstLegs("d1", fail_decode_after=3)
    factory.engines["d2"] = FailsFirstLegs("d2", fail_decode_after=3)
    rt = prepared(
        factory,
        ("p1", EngineRole.PREFILL),
        ("p2", EngineRole.PREFILL),
        ("d1", EngineRole.DECODE),
        ("d2", EngineRole.DECODE),
    )
    async with http(rt) as transport:
        client = openai.AsyncOpenAI(
            base_url="http://router/v1", api_key="unused", http_client=transport, max_retries=0
        )
        if stream:
            events = await client.completions.create(
                model=MODEL,
                prompt="hello there",
                max_tokens=10,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            finish, usage = None, None
            async for event in events:
                if event.choices:
                    finish = event.choices[0].finish_reason or finish
                if event.usage is not None:
                    usage = event.usage
        else:
            raw = await client.completions.with_raw_response.create(
                model=MODEL, prompt="hello there", max_tokens=10, temperature=0
            )
            result = raw.parse()
            finish, usage = result.choices[0].finish_reason, result.usage
            assert raw.headers["x-pdserve-migrations"] == "1"
    assert finish == "length"
    assert usage is not None and usage.completion_tokens == 10  # each token counted once
    # A stream's usage says it migrated (its headers went out before); a plain answer says so
    # in its x-pdserve-migrations header (above), and vLLM's usage has no pdserve field.
    assert usage.model_extra == ({"pdserve_migrations": 1} if stream else {})
    assert sample(rt, "pdserve_router_migrations_total", reason="decode_failed") == 1
    assert (
        sample(rt, "pdserve_router_requests_total", endpoint="/v1/completions", outcome="ok") == 1
    )
    # The second decode engine got prompt + the 4 tokens so far, and the 6 that were left.
    decodes = [d for e in ("d1", "d2") for d in factory.engines[e].decodes]
    moved = [d for d in decodes if d.request_id.endswith(".m1")]
    first = [d for d in decodes if ".m" not in d.request_id]
    assert len(moved) == 1 and len(first) == 1
    assert moved[0].sampling.max_tokens == 6
    assert moved[0].sampling.output_tokens_in_prompt == 4  # the tokens so far count as output
    assert first[0].sampling.output_tokens_in_prompt == 0
    assert moved[0].prompt_token_ids[: len(first[0].prompt_token_ids)] == first[0].prompt_token_ids
    assert len(moved[0].prompt_token_ids) == len(first[0].prompt_token_ids) + 4


async def test_a_non_streamed_request_on_a_stalled_decode_engine_migrates(
    factory: FakeFactory,
) -> None:
    """The unary decode's idle bound trips on d1 (it stalls after 2 tokens): the request
    continues on d2, counted as an ``engine_timeout`` migration, the client gets every token."""
    factory.engines["d1"] = FakeEngine("d1", stall_decode_after=2)
    rt = prepared(
        factory,
        ("p1", EngineRole.PREFILL),
        ("d1", EngineRole.DECODE),
        ("d2", EngineRole.DECODE),
        decode_idle_timeout_s=0.2,
    )
    for _ in range(2):  # whichever decode engine comes first
        reply = await completion(rt, max_tokens=6)
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 6
    await rt.executor.close()  # the best-effort aborts have run
    stalled = factory.engines["d1"]
    assert stalled.once and stalled.aborted == stalled.once
    assert sample(rt, "pdserve_router_migrations_total", reason="engine_timeout") == 1
    assert sample(rt, "pdserve_router_engine_timeouts_total", call="decode", bound="idle") == 1


async def test_one_decode_engine_only_fails_explicitly_and_at_once(factory: FakeFactory) -> None:
    rt = prepared(factory, ("p1", EngineRole.PREFILL), ("d1", EngineRole.DECODE))
    factory.engines["d1"].decode_error = EngineFailed("rank (0, 0) exited")
    reply = await completion(rt, max_tokens=5)
    assert reply.status_code == 502
    error = reply.json()["error"]
    assert error["code"] == 502  # vLLM's error body: the code is the HTTP status
    assert "could not continue elsewhere" in error["message"]
    assert "rank (0, 0) exited" in error["message"]
    # The router's own code is the request's outcome.
    assert outcomes(rt) == {"engine_failed": 1}
    # Nowhere to go: not counted as a migration.
    assert sample(rt, "pdserve_router_migrations_total", reason="engine_failed") == 0
    assert sample(rt, "pdserve_router_circuit_trips_total", engine="d1", role="decode") == 1


async def test_a_failed_engine_is_left_out_at_once_and_shown_open(factory: FakeFactory) -> None:
    # A back-off no loaded machine outlasts: the four requests must not reach its probe.
    rt = prepared(
        factory,
        ("p1", EngineRole.PREFILL),
        ("p2", EngineRole.PREFILL),
        ("d1", EngineRole.DECODE),
        ("d2", EngineRole.DECODE),
        circuit_backoff_s=600.0,
        circuit_max_backoff_s=600.0,
    )
    factory.engines["p1"].prefill_error = EngineUnreachable("connection refused", "127.0.0.1:1")
    for _ in range(4):
        reply = await completion(rt, max_tokens=2)
        assert reply.status_code == 200, reply.text
    assert len(factory.engines["p1"].prefills) == 1, "p1 chosen again while its circuit was open"
    assert sample(rt, "pdserve_router_circuit_trips_total", engine="p1", role="prefill") == 1
    state = sample(
        rt, "pdserve_router_engine_circuit_state", engine="p1", role="prefill", state="open"
    )
    assert state == 1
    assert (
        sample(
            rt, "pdserve_router_engine_circuit_state", engine="p2", role="prefill", state="closed"
        )
        == 1
    )


async def test_a_migration_that_runs_out_of_attempts_ends_the_stream_with_the_error(
    factory: FakeFactory,
) -> None:
    rt = prepared(
        factory,
        ("p1", EngineRole.PREFILL),
        ("d1", EngineRole.DECODE),
        ("d2", EngineRole.DECODE),
        max_migrations=0,
    )
    for engine in ("d1", "d2"):
        factory.engines[engine].fail_decode_after = 2
    reply = await completion(rt, max_tokens=10, stream=True)
    assert reply.status_code == 200, reply.text
    events = json_events(reply.text)
    # (a token that came with the failure may be in no event: the error replaces it)
    assert "".join(e["choices"][0]["text"] for e in events[:-1]).startswith(text_of(7, 101))
    error = events[-1]["error"]  # vLLM's error event: the code is the HTTP status
    assert error["code"] == 502
    assert "failed the request: rank 0 died" in error["message"]
    assert outcomes(rt) == {"decode_failed": 1}
    assert sample(rt, "pdserve_router_migrations_total", reason="decode_failed") == 0
