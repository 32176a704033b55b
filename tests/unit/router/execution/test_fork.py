"""``n > 1`` on the router: one prefill and one forked decode on a pair that forks (reference
engines), one request per choice otherwise; a failure is each choice's, with the failover and
migration of a single request: another prefill engine, the local fallback, or each unfinished
choice continued on other engines (an error where none is left)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.bench.sse import json_events
from services.control_plane.wire import EngineLoad, EngineRole
from services.engines.errors import EngineFailed
from services.router.runtime import RouterRuntime
from services.serving.errors import EngineUnreachable
from tests.unit.router.fakes import (
    MODEL,
    BlamesProducer,
    FailsFirstLegs,
    FakeFactory,
    http,
    outcomes,
    runtime,
    sample,
    text_of,
    view,
)


def pair(
    factory: FakeFactory, kind: str = "reference", *more: str, **settings: object
) -> RouterRuntime:
    """p1 and d1 of engine ``kind``, and ``more`` engines (``p2``, ``d2``: the role by the
    first letter) which the least-loaded policy chooses only once p1 or d1 is left out."""
    rt = runtime(factory, **settings)
    rt.pool.update("p1", view("p1", EngineRole.PREFILL, engine_kind=kind))
    rt.pool.update("d1", view("d1", EngineRole.DECODE, engine_kind=kind))
    for engine in more:
        role = EngineRole.PREFILL if engine.startswith("p") else EngineRole.DECODE
        busy = EngineLoad(queue_depth=5)
        rt.pool.update(engine, view(engine, role, engine_kind=kind, load=busy))
    rt.pool._synced.set()
    return rt


async def completion(rt: RouterRuntime, **body: object) -> httpx.Response:
    async with http(rt) as transport:
        return await transport.post(
            "http://router/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "temperature": 1.0, **body},
        )


@pytest.fixture
def factory() -> FakeFactory:
    return FakeFactory()


async def test_n_choices_fork_from_one_prefill_and_one_decode(factory: FakeFactory) -> None:
    rt = pair(factory)
    reply = await completion(rt, n=3, max_tokens=4, seed=5)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    texts = [choice["text"] for choice in body["choices"]]
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    assert texts == [text_of(7, 101, 102, 103)] * 3  # each fork's tokens (the fakes' are alike)
    assert body["usage"]["completion_tokens"] == 3 * 4
    assert len(factory.engines["p1"].prefills) == 1
    (decode,) = factory.engines["d1"].decodes
    assert [fork.choice for fork in decode.forks] == [0, 1, 2]
    assert decode.sampling.n == 1 and decode.sampling.seed == 5  # each fork offsets it
    assert sample(rt, "pdserve_router_choices_total", path="forked") == 1


async def test_n_choices_stream_from_one_forked_decode(factory: FakeFactory) -> None:
    rt = pair(factory)
    reply = await completion(rt, n=2, max_tokens=3, stream=True)
    assert reply.status_code == 200, reply.text
    texts: dict[int, str] = {}
    for event in json_events(reply.text):
        for choice in event["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert texts == {0: text_of(7, 101, 102), 1: text_of(7, 101, 102)}
    assert len(factory.engines["p1"].prefills) == 1
    (decode,) = factory.engines["d1"].decodes
    assert [fork.choice for fork in decode.forks] == [0, 1]
    assert sample(rt, "pdserve_router_choices_total", path="forked") == 1


async def test_each_forked_choice_counts_its_path_and_first_token(factory: FakeFactory) -> None:
    """As a single request's, once per choice (vLLM's TTFT observes each of a request's n);
    the prompt is counted once in ``pdserve_router_choices_total``."""
    rt = pair(factory)
    reply = await completion(rt, n=3, max_tokens=4)
    assert reply.status_code == 200, reply.text
    assert reply.headers["x-pdserve-execution-path"] == "forked"
    assert sample(rt, "pdserve_router_execution_path_total", path="forked") == 3
    assert sample(rt, "pdserve_router_ttft_seconds_count", path="forked") == 3
    assert sample(rt, "pdserve_router_execution_path_total", path="disaggregated") == 0
    assert sample(rt, "pdserve_router_choices_total", path="forked") == 1


def phases(rt: RouterRuntime) -> dict[str, float]:
    """How many of each TTFT phase, and of ITL gaps, ``rt`` observed."""
    counted = {
        phase: sample(rt, "pdserve_router_ttft_phase_seconds_count", phase=phase)
        for phase in ("prefill", "handoff", "first_decode_token")
    }
    counted["itl"] = sample(rt, "pdserve_router_itl_seconds_count")
    return counted


@pytest.mark.parametrize("stream", [False, True])
async def test_each_forked_choice_times_the_phases_a_single_run_does(stream: bool) -> None:
    """A single run of 4 tokens (the prefill's, then 3 decode deltas) observes one prefill,
    one handoff and, streamed, one first decode token and 3 ITL gaps (the first from the
    Decode call's start); not streamed, its answer comes whole: neither. Forked, each of the 3
    choices observes its own first decode token and gaps, and the prompt its one Prefill call
    and one KV transfer (docs/metrics.md)."""
    single = pair(FakeFactory())
    reply = await completion(single, max_tokens=4, stream=stream)
    assert reply.status_code == 200, reply.text
    decoded = 1 if stream else 0
    assert phases(single) == {
        "prefill": 1,
        "handoff": 1,
        "first_decode_token": decoded,
        "itl": 3 * decoded,
    }
    forked = pair(FakeFactory())
    reply = await completion(forked, n=3, max_tokens=4, stream=stream)
    assert reply.status_code == 200, reply.text
    assert sample(forked, "pdserve_router_choices_total", path="forked") == 1
    assert phases(forked) == {
        "prefill": 1,
        "handoff": 1,
        "first_decode_token": 3 * decoded,
        "itl": 3 * 3 * decoded,
    }


async def test_a_pair_that_cannot_fork_runs_a_request_per_choice(factory: FakeFactory) -> None:
    rt = pair(factory, kind="vllm")
    reply = await completion(rt, n=3, max_tokens=4)
    assert reply.status_code == 200, reply.text
    assert [choice["index"] for choice in reply.json()["choices"]] == [0, 1, 2]
    assert len(factory.engines["p1"].prefills) == 3
    assert all(not decode.forks for decode in factory.engines["d1"].decodes)
    assert sample(rt, "pdserve_router_choices_total", path="per_choice") == 1


async def test_a_failed_forked_decode_fails_every_choice(factory: FakeFactory) -> None:
    rt = pair(factory)
    factory.engines["d1"].decode_error = EngineFailed("rank (0, 0) exited")
    reply = await completion(rt, n=3, max_tokens=4)
    assert reply.status_code == 502, reply.text
    error = reply.json()["error"]
    assert error["code"] == 502  # vLLM's error body: the code is the HTTP status
    assert "rank (0, 0) exited" in error["message"]
    assert outcomes(rt) == {"engine_failed": 1}  # one request, counted once
    assert sample(rt, "pdserve_router_circuit_trips_total", engine="d1", role="decode") == 1


async def test_a_stalled_forked_decode_times_out_and_is_aborted_on_both_engines(
    factory: FakeFactory,
) -> None:
    """The forked run's bounds are the executor's: a decode engine that sends no first delta
    ends every choice with ``engine_timeout`` (counted, the engine's breaker fed), the request
    is aborted on the decode engine, and the KV the prefill engine holds is released."""
    rt = pair(factory, decode_idle_timeout_s=0.2)
    decode = factory.engines["d1"]
    decode.stall_decode_after = 0
    # The idle bound ends it; the outer bound only keeps a broken bound from hanging the test.
    reply = await asyncio.wait_for(completion(rt, n=3, max_tokens=4), 120.0)
    await rt.executor.close()  # the best-effort aborts have run
    assert reply.status_code == 504, reply.text
    error = reply.json()["error"]
    assert error["code"] == 504
    assert "decode_idle_timeout_s=0.2" in error["message"]
    assert outcomes(rt) == {"engine_timeout": 1}
    assert "sent no first token" in error["message"]
    (request,) = decode.decodes
    assert len(request.forks) == 3
    assert decode.stalled_calls_closed == [request.request_id]  # the call was cancelled
    assert decode.aborted == [request.request_id]  # and the engine was sent an Abort
    assert factory.engines["p1"].aborted == [request.request_id]  # the held KV released
    assert sample(rt, "pdserve_router_engine_timeouts_total", call="decode", bound="idle") == 1
    assert sample(rt, "pdserve_router_aborts_total", role="decode", outcome="found") == 1
    assert sample(rt, "pdserve_router_aborts_total", role="prefill", outcome="found") == 1
    assert sample(rt, "pdserve_router_choices_total", path="forked") == 1


async def test_a_stalled_forked_prefill_times_out_and_is_aborted_on_the_prefill_engine(
    factory: FakeFactory,
) -> None:
    rt = pair(factory, prefill_timeout_s=0.2, local_fallback=False)
    prefill = factory.engines["p1"]
    prefill.stall_prefill = True
    reply = await asyncio.wait_for(completion(rt, n=2, max_tokens=4), 120.0)
    await rt.executor.close()
    assert reply.status_code == 504, reply.text
    error = reply.json()["error"]
    assert error["code"] == 504
    assert "prefill_timeout_s=0.2" in error["message"]
    assert outcomes(rt) == {"engine_timeout": 1}
    assert prefill.aborted == prefill.stalled_calls_closed and len(prefill.aborted) == 1
    assert not factory.engines["d1"].decodes
    assert sample(rt, "pdserve_router_engine_timeouts_total", call="prefill", bound="deadline") == 1


async def test_a_forked_prefill_with_no_engine_left_falls_back_to_local_choices(
    factory: FakeFactory,
) -> None:
    """As a single request's: every prefill engine failed, so each choice runs locally on the
    planned decode engine (counted once, as the prompt's fallback)."""
    rt = pair(factory, prefill_timeout_s=0.2)
    factory.engines["p1"].stall_prefill = True
    reply = await asyncio.wait_for(completion(rt, n=2, max_tokens=4), 120.0)
    await rt.executor.close()
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [choice["finish_reason"] for choice in body["choices"]] == ["length"] * 2
    assert body["usage"]["completion_tokens"] == 2 * 4
    assert len(factory.engines["p1"].aborted) == 1  # the stalled prefill, aborted once
    decodes = factory.engines["d1"].decodes
    assert len(decodes) == 2 and all(d.kv_handle is None and not d.forks for d in decodes)
    assert sample(rt, "pdserve_router_fallbacks_total", reason="prefill_failed") == 1
    assert sample(rt, "pdserve_router_execution_path_total", path="local") == 2


async def test_a_forked_prefill_that_fails_is_forked_again_on_another_prefill_engine(
    factory: FakeFactory,
) -> None:
    rt = pair(factory, "reference", "p2")
    factory.engines["p1"].prefill_error = EngineUnreachable("connection refused", "127.0.0.1:1")
    reply = await completion(rt, n=2, max_tokens=4, seed=5)
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [choice["text"] for choice in body["choices"]] == [text_of(7, 101, 102, 103)] * 2
    assert len(factory.engines["p1"].prefills) == 1 and len(factory.engines["p2"].prefills) == 1
    (decode,) = factory.engines["d1"].decodes
    assert [fork.choice for fork in decode.forks] == [0, 1]
    assert decode.kv_handle is not None and decode.kv_handle.producer_engine_id == "p2"
    retries = sample(
        rt, "pdserve_router_prefill_retries_total", phase="connect", reason="engine_unreachable"
    )
    assert retries == 1
    assert sample(rt, "pdserve_router_choices_total", path="forked") == 1


async def test_each_choice_of_a_fork_whose_producer_died_is_prefilled_again_elsewhere(
    factory: FakeFactory,
) -> None:
    """d1 cannot pull the forked KV from p1: no choice had a decode token, so each is
    continued from its first token by a prefill on p2 (counted per choice), and the KV p1
    holds is released once."""
    factory.engines["d1"] = BlamesProducer("d1")
    rt = pair(factory, "reference", "p2")
    reply = await completion(rt, n=2, max_tokens=4)
    await rt.executor.close()
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert [choice["finish_reason"] for choice in body["choices"]] == ["length"] * 2
    assert body["usage"]["completion_tokens"] == 2 * 4
    forked, *continued = factory.engines["d1"].decodes
    assert len(forked.forks) == 2 and factory.engines["p1"].aborted == [forked.request_id]
    assert sorted(d.request_id.rsplit(".", 1)[1] for d in continued) == ["m1", "m1"]
    assert all(d.sampling.max_tokens == 3 and d.prompt_token_ids[-1] == 7 for d in continued)
    assert len(factory.engines["p2"].prefills) == 2
    retries = sample(
        rt, "pdserve_router_prefill_retries_total", phase="kv_pull", reason="kv_transfer_failed"
    )
    assert retries == 2
    assert sample(rt, "pdserve_router_circuit_trips_total", engine="d1", role="decode") == 0


@pytest.mark.parametrize("stream", [False, True])
async def test_each_choice_of_a_forked_decode_that_dies_migrates(
    factory: FakeFactory, stream: bool
) -> None:
    """The forked decode fails after each choice's third token: each choice continues on d2
    from its own tokens (its prompt and what is left), counted as a migration each; the
    breaker of d1 trips once."""
    factory.engines["d1"] = FailsFirstLegs("d1", fail_decode_after=2)
    rt = pair(factory, "reference", "d2")
    reply = await completion(rt, n=2, max_tokens=6, stream=stream, seed=5)
    assert reply.status_code == 200, reply.text
    finish: dict[int, str] = {}
    for event in json_events(reply.text) if stream else [reply.json()]:
        assert "error" not in event, event
        for choice in event["choices"]:
            finish[choice["index"]] = choice["finish_reason"] or finish.get(choice["index"], "")
    assert finish == {0: "length", 1: "length"}
    (forked,) = factory.engines["d1"].decodes
    assert len(forked.forks) == 2
    moved = factory.engines["d2"].decodes
    assert len(moved) == 2 and all(d.request_id.endswith(".m1") and not d.forks for d in moved)
    assert all(d.sampling.max_tokens == 3 for d in moved)  # each choice had sent 3 tokens
    assert all(d.sampling.output_tokens_in_prompt == 3 for d in moved)
    assert sorted(d.sampling.seed for d in moved) == [5, 6]  # each choice's own seed
    assert sample(rt, "pdserve_router_migrations_total", reason="decode_failed") == 2
    assert sample(rt, "pdserve_router_circuit_trips_total", engine="d1", role="decode") == 1
    assert outcomes(rt) == {"ok": 1}


async def test_n_choices_at_temperature_zero_are_refused_before_any_engine_call(
    factory: FakeFactory,
) -> None:
    """vLLM's front end refuses ``n > 1`` with greedy sampling (every choice would be the
    same): a 400 naming the rule, nothing planned or forked."""
    rt = pair(factory)
    reply = await completion(rt, n=2, max_tokens=4, temperature=0)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == 400
    assert "n must be 1 when using greedy sampling" in error["message"]
    assert not factory.engines["p1"].prefills and not factory.engines["d1"].decodes
    assert sample(rt, "pdserve_router_choices_total", path="forked") == 0
    assert outcomes(rt) == {"invalid_request": 1}
