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


async def placed(rt: RouterRuntime) -> tuple[str, str, str]:
    """One completion of PROMPT through the router's HTTP app: (path, prefill engine or "",
    decode engine)."""
    async with http(rt) as client:
        response = await client.post(
            "/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2}
        )
    assert response.status_code == 200, response.text
    headers = response.headers
    return (
        headers["x-pdserve-execution-path"],
        headers.get("x-pdserve-prefill-engine", ""),
        headers["x-pdserve-decode-engine"],
    )


async def completion(rt: RouterRuntime) -> str:
    return (await placed(rt))[1]


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


def evented(engine_id: str, role: EngineRole, pub: Publisher):
    return view(
        engine_id,
        role,
        kv_events_endpoint=pub.endpoint,
        kv_events_replay_endpoint=pub.replay_endpoint,
    )


async def test_two_router_replicas_place_alike_from_events_on_both_pools():
    """Two routers (as two replicas or two ``--workers``) with no shared state subscribe to
    the same four engines: both send the prompt's prefill and decode where the events say it
    is, and both run it on the decode engine alone once that engine holds all of it."""
    publishers = {name: Publisher() for name in ("p1", "p2", "d1", "d2")}
    routers = []
    try:
        for _ in range(2):
            rt = runtime(FakeFactory(), policy="prefix_aware", local_cached_fraction=0.9)
            for name, pub in publishers.items():
                role = EngineRole.PREFILL if name.startswith("p") else EngineRole.DECODE
                rt.pool.update(name, evented(name, role, pub))
            rt.pool._synced.set()
            routers.append(rt)
        await asyncio.sleep(0.5)
        publishers["p2"].blocks(PROMPT[:32], range(100, 108))
        publishers["d2"].blocks(PROMPT[:24], range(300, 306))
        for rt in routers:
            assert rt.kv_events is not None
            index, pool = rt.kv_events.index, rt.pool
            await wait_until(
                lambda index=index, pool=pool: (
                    index.blocks_of(pool.get("p2")) == 8 and index.blocks_of(pool.get("d2")) == 6
                ),
                "the events",
            )
        for rt in routers:
            assert await placed(rt) == ("disaggregated", "p2", "d2")
            assert sample(rt, "pdserve_router_kv_blocks_moved_sum") == 10 - 6
        # d2 completes the prompt (the decode of a previous turn): it holds all 10 blocks.
        publishers["d2"].blocks(PROMPT[24:], range(306, 310), parent=305)
        for rt in routers:
            index, pool = rt.kv_events.index, rt.pool
            await wait_until(
                lambda index=index, pool=pool: index.blocks_of(pool.get("d2")) == 10, "d2"
            )
            assert await placed(rt) == ("local", "", "d2")
            assert (
                sample(
                    rt,
                    "pdserve_router_placement_decisions_total",
                    pool="local",
                    reason="cached_prompt",
                )
                == 1
            )
    finally:
        for rt in routers:
            await rt.close()
        for pub in publishers.values():
            pub.shutdown()
