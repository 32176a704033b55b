"""``n > 1`` on the router: one prefill and one forked decode on a pair that forks (reference
engines), one request per choice otherwise; failures end every choice."""

from __future__ import annotations

import json

import httpx
import pytest

from services.control_plane.wire import EngineRole
from services.engines.errors import EngineFailed
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import FakeFactory, http, runtime, sample, view

MODEL = "tiny"


def pair(factory: FakeFactory, kind: str = "reference") -> RouterRuntime:
    rt = runtime(factory)
    rt.pool.update("p1", view("p1", EngineRole.PREFILL, engine_kind=kind))
    rt.pool.update("d1", view("d1", EngineRole.DECODE, engine_kind=kind))
    rt.pool._synced.set()
    return rt


async def completion(rt: RouterRuntime, **body: object) -> httpx.Response:
    async with http(rt) as transport:
        return await transport.post(
            "http://router/v1/completions",
            json={"model": MODEL, "prompt": "hello there", "temperature": 0, **body},
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
    assert len(set(texts)) == 1 and texts[0]
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
    for line in reply.text.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1] and texts[0] == texts[1] and texts[0]
    assert len(factory.engines["d1"].decodes) == 1


async def test_a_pair_that_cannot_fork_runs_a_request_per_choice(factory: FakeFactory) -> None:
    rt = pair(factory, kind="vllm")
    reply = await completion(rt, n=3, max_tokens=4)
    assert reply.status_code == 200, reply.text
    assert len(factory.engines["p1"].prefills) == 3
    assert all(not decode.forks for decode in factory.engines["d1"].decodes)
    assert sample(rt, "pdserve_router_choices_total", path="per_choice") == 1


async def test_a_failed_forked_decode_fails_every_choice(factory: FakeFactory) -> None:
    rt = pair(factory)
    factory.engines["d1"].decode_error = EngineFailed("rank (0, 0) exited")
    reply = await completion(rt, n=3, max_tokens=4)
    assert reply.status_code == 502, reply.text
    assert reply.json()["error"]["code"] == "engine_failed"
    assert sample(rt, "pdserve_router_circuit_trips_total", engine="d1", role="decode") == 1
