"""A router (in process, real HTTP through its ASGI app) follows two prefill engines' KV
events from vLLM's real publishers on ZMQ and sends each request to the engine whose events
say it holds the prompt; engines' gRPC calls are the unit tests' fake connectors."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from services.control_plane.wire import EngineRole
from services.router.runtime import RouterRuntime
from tests.integration.kv_events.harness import Publisher, wait_until
from tests.unit.router.fakes import FakeFactory, http, runtime, sample, view

pytestmark = pytest.mark.integration

PROMPT = list(range(1, 41))  # 10 blocks of 4


@pytest.fixture
async def stack() -> AsyncIterator[tuple[RouterRuntime, FakeFactory, dict[str, Publisher]]]:
    factory = FakeFactory()
    rt = runtime(factory, policy="prefix_aware", local_cached_fraction=2.0)
    publishers = {"p1": Publisher(), "p2": Publisher()}
    for engine_id, pub in publishers.items():
        rt.pool.update(
            engine_id,
            view(
                engine_id,
                EngineRole.PREFILL,
                kv_events_endpoint=pub.endpoint,
                kv_events_replay_endpoint=pub.replay_endpoint,
            ),
        )
    rt.pool.update("d1", view("d1", EngineRole.DECODE))
    rt.pool._synced.set()
    try:
        yield rt, factory, publishers
    finally:
        await rt.close()
        for pub in publishers.values():
            pub.shutdown()


async def completion(rt: RouterRuntime) -> str:
    async with http(rt) as client:
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        )
    assert response.status_code == 200, response.text
    engine: str = response.headers["x-pdserve-prefill-engine"]
    return engine


async def test_requests_go_to_the_prefill_engine_whose_events_hold_the_prompt(stack):
    rt, factory, publishers = stack
    assert rt.kv_events is not None
    index = rt.kv_events.index
    p1, p2 = rt.pool.get("p1"), rt.pool.get("p2")
    await asyncio.sleep(0.5)  # both subscriptions reach their publishers
    publishers["p2"].blocks(PROMPT[:32], range(100, 108))  # p2 holds 8 of the 10 blocks
    await wait_until(lambda: index.blocks_of(p2) == 8, "p2's events")
    assert [await completion(rt) for _ in range(3)] == ["p2"] * 3
    assert factory.engines["p1"].prefills == []
    assert (
        sample(rt, "pdserve_router_placement_decisions_total", pool="prefill", reason="cached") == 3
    )
    assert sample(rt, "pdserve_router_cached_tokens_sum", pool="prefill") == 3 * 32

    # p2 evicts the prompt's second block; p1 stores the whole prompt: p1 now holds more.
    publishers["p2"].removed([101])
    publishers["p1"].blocks(PROMPT, range(200, 210))
    await wait_until(
        lambda: index.blocks_of(p2) == 7 and index.blocks_of(p1) == 10, "both engines' events"
    )
    assert await completion(rt) == "p1"
    assert sample(rt, "pdserve_router_kv_events_received_total") == 3
    assert sample(rt, "pdserve_router_kv_index_blocks") == 17

    # p1's publisher dies: p1 is stale and placed by load only, so p2's one block still
    # cached (the first; the prefix ends at the removed second) outweighs p1's ten.
    publishers["p1"].shutdown()
    await wait_until(lambda: not index.tracks(p1), "p1 stale")
    assert sample(rt, "pdserve_router_kv_events_stale_engines") == 1
    assert sample(rt, "pdserve_router_kv_events_stale_total", reason="disconnected") == 1
    assert [await completion(rt) for _ in range(2)] == ["p2"] * 2

    # p1 restarts as a new generation without events: its old entries and subscription go.
    rt.pool.update("p1", view("p1", EngineRole.PREFILL, generation=2))
    assert index.blocks_of(p1) == 0 and rt.kv_events.subscriber(p1) is None
    assert sample(rt, "pdserve_router_kv_index_blocks") == 7
