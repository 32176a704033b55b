"""LoRA adapters through the router's front end (vLLM's ``OpenAIServingModels`` over
services/router/frontend/vllm/lora.py), over fake engines: loads reach every engine with LoRA
slots, a partial load is reported and served by the engines that hold the adapter, engines
without slots are refused naming them, unloads reach the engines, and requests carry the
adapter to prefill and decode."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from services.control_plane.wire import EngineLoad, EngineRole
from services.engines.errors import InvalidRequest
from services.engines.lora import LoRAAdapter
from services.engines.reference.tiny_model import make_tiny_model
from services.router.main import create_app
from services.router.runtime import RouterRuntime
from tests.unit.router.fakes import FakeFactory, runtime, sample, view

MODEL = "tiny"
PREFILL, DECODE = EngineRole.PREFILL, EngineRole.DECODE
RANK_MESSAGE = "Call to add_lora method failed: LoRA rank 32 is greater than max_lora_rank 16."


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("lora-frontend") / "tiny-model")


@pytest.fixture(autouse=True)
def runtime_updates(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM serves its load and unload routes only with this set (read when the app is built)."""
    monkeypatch.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")


def lora_runtime(
    factory: FakeFactory, model_dir: Path, engines: dict[str, EngineRole], *, slots: int = 2
) -> RouterRuntime:
    rt = runtime(
        factory,
        tokenizer=str(model_dir),
        served_model_name=MODEL,
        frontend_args=["--enable-lora"],
        local_max_prompt_tokens=0,
    )
    for engine_id, role in engines.items():
        base = view(engine_id, role, load=EngineLoad())
        kind = "vllm" if slots else "reference"
        record = dataclasses.replace(base.record, max_loras=slots, engine_kind=kind)
        rt.pool.update(engine_id, dataclasses.replace(base, record=record))
    rt.pool._synced.set()
    return rt


@contextlib.asynccontextmanager
async def served_client(rt: RouterRuntime) -> AsyncIterator[httpx.AsyncClient]:
    """The router app over ``rt``, its lifespan run (vLLM's front end builds its state there)."""
    app = create_app(rt.settings, runtime=rt)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            yield client


async def complete(client: httpx.AsyncClient, model: str) -> httpx.Response:
    return await client.post(
        "/v1/completions",
        json={"model": model, "prompt": "Hello there", "max_tokens": 3, "temperature": 0},
    )


async def test_an_adapter_loads_on_every_engine_and_its_requests_carry_it(
    model_dir: Path, tmp_path: Path
) -> None:
    factory = FakeFactory()
    rt = lora_runtime(factory, model_dir, {"p0": PREFILL, "d0": DECODE, "d1": DECODE})
    async with served_client(rt) as client:
        load = {"lora_name": "sql", "lora_path": str(tmp_path / "sql")}
        answer = await client.post("/v1/load_lora_adapter", json=load)
        assert answer.status_code == 200, answer.text
        assert answer.text == "Success: LoRA adapter 'sql' added successfully."
        sql = LoRAAdapter("sql", str(tmp_path / "sql"))
        for engine in ("p0", "d0", "d1"):
            assert factory.engines[engine].lora_loads == [(sql, False)]
        cards = (await client.get("/v1/models")).json()["data"]
        assert [(c["id"], c["parent"], c["root"]) for c in cards[1:]] == [
            ("sql", MODEL, str(tmp_path / "sql"))
        ]
        answer = await complete(client, "sql")
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "sql"
        assert answer.headers["x-pdserve-execution-path"] == "disaggregated"
        calls = [(e, call, lora) for e, f in factory.engines.items() for call, _, lora in f.loras]
        assert {call for _, call, _ in calls} == {"prefill", "decode"}
        assert all(lora == sql for _, _, lora in calls)
        base = await complete(client, MODEL)
        assert base.status_code == 200
        assert factory.engines["p0"].loras[-1][2] is None
        assert sample(rt, "pdserve_router_lora_loads_total", pool="api", outcome="ok") == 3

        answer = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        assert answer.status_code == 200, answer.text
        assert all(f.held_loras == () for f in factory.engines.values())
        gone = await complete(client, "sql")
        assert gone.status_code == 404
        assert gone.json()["error"]["message"] == (
            f"The model `sql` does not exist. Valid aliases: {MODEL}."
        )


async def test_a_load_that_fails_on_one_engine_is_partial_and_served_where_it_loaded(
    model_dir: Path, tmp_path: Path
) -> None:
    factory = FakeFactory()
    rt = lora_runtime(factory, model_dir, {"p0": PREFILL, "d0": DECODE, "d1": DECODE})
    async with served_client(rt) as client:
        factory.engines["d1"].held_loras = ("older",)
        factory.engines["d1"].lora_load_error = InvalidRequest(RANK_MESSAGE)
        load = {"lora_name": "sql", "lora_path": str(tmp_path / "sql")}
        answer = await client.post("/v1/load_lora_adapter", json=load)
        assert answer.status_code == 500
        message = answer.json()["error"]["message"]
        assert "loaded on 2 of 3 engines (partial)" in message
        assert f"d1: {RANK_MESSAGE}" in message
        assert factory.engines["d1"].held_loras == ("older",)  # it keeps what it had
        assert sample(rt, "pdserve_router_lora_loads_total", pool="api", outcome="failed") == 1
        # Served by the engines that hold it, never by d1, even when d1 is less loaded.
        (d0,) = [slot for slot in rt.pool.slots() if slot.engine_id == "d0"]
        d0.inflight = 5
        for _ in range(3):
            answer = await complete(client, "sql")
            assert answer.status_code == 200, answer.text
            assert answer.headers["x-pdserve-decode-engine"] == "d0"
        assert all(lora is None for _, _, lora in factory.engines["d1"].loras)
        assert sample(rt, "pdserve_router_lora_loads_total", pool="decode", outcome="ok") == 0


async def test_a_load_every_engine_refuses_answers_the_engines_message(
    model_dir: Path, tmp_path: Path
) -> None:
    factory = FakeFactory()
    rt = lora_runtime(factory, model_dir, {"p0": PREFILL, "d0": DECODE})
    async with served_client(rt) as client:
        for engine in factory.engines.values():
            engine.lora_load_error = InvalidRequest(RANK_MESSAGE)
        load = {"lora_name": "big", "lora_path": str(tmp_path / "big")}
        answer = await client.post("/v1/load_lora_adapter", json=load)
        assert answer.status_code == 500
        assert RANK_MESSAGE in answer.json()["error"]["message"]
        assert (await complete(client, "big")).status_code == 404
        ids = [card["id"] for card in (await client.get("/v1/models")).json()["data"]]
        assert ids == [MODEL]


async def test_engines_without_lora_slots_refuse_a_load_with_a_400_naming_them(
    model_dir: Path, tmp_path: Path
) -> None:
    factory = FakeFactory()
    rt = lora_runtime(factory, model_dir, {"p0": PREFILL, "d0": DECODE}, slots=0)
    async with served_client(rt) as client:
        load = {"lora_name": "sql", "lora_path": str(tmp_path / "sql")}
        answer = await client.post("/v1/load_lora_adapter", json=load)
        assert answer.status_code == 400
        message = answer.json()["error"]["message"]
        assert "d0 (reference engine)" in message and "p0 (reference engine)" in message
        assert all(not engine.lora_loads for engine in factory.engines.values())
        unknown = await complete(client, "sql")
        assert unknown.status_code == 404
        assert unknown.json()["error"]["type"] == "NotFoundError"
