"""Several base models behind one router (services/router/frontend/vllm/model_states.py), over
fake engines: each model's requests run on its own engines with its own front end (context,
tokenizer), ``/v1/models`` lists every model, an unknown name is vLLM's 404, and the
per-model metrics carry only served names."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from starlette.datastructures import State

from services.control_plane.wire import EngineRole
from services.engines.lora import LoRAAdapter
from services.router.config import ServedModelSettings
from services.router.frontend.vllm.model_states import ModelStates
from services.tokenization.synthetic_checkpoint import write_synthetic_checkpoint
from tests.unit.router.fakes import MODEL, FakeFactory, http, prepared, sample, view

PREFILL, DECODE = EngineRole.PREFILL, EngineRole.DECODE
OTHER = "other"


@pytest.fixture(scope="module")
def other_checkpoint() -> Path:
    """A second model: another vocabulary and a shorter context than the first's."""
    root = Path(tempfile.mkdtemp(prefix="pdserve-other-"))
    return write_synthetic_checkpoint(root / OTHER, vocab_size=1000, max_model_len=512)


def two_models(factory: FakeFactory, other_checkpoint: Path) -> object:
    rt = prepared(
        factory,
        ("tiny-prefill", PREFILL),
        ("tiny-decode", DECODE),
        served_model_name=MODEL,
        models=[ServedModelSettings(tokenizer=other_checkpoint)],
        local_max_prompt_tokens=0,
        local_cached_fraction=2,
    )
    rt.pool.update("other-prefill", view("other-prefill", PREFILL, model=OTHER, compat_hash="h2"))
    rt.pool.update("other-decode", view("other-decode", DECODE, model=OTHER, compat_hash="h2"))
    return rt


async def test_each_model_runs_on_its_engines_and_models_lists_both(
    other_checkpoint: Path,
) -> None:
    factory = FakeFactory()
    rt = two_models(factory, other_checkpoint)
    async with http(rt) as client:  # type: ignore[arg-type]
        listing = (await client.get("/v1/models")).json()
        cards = {card["id"]: card for card in listing["data"]}
        assert list(cards) == [MODEL, OTHER]
        assert (cards[MODEL]["max_model_len"], cards[OTHER]["max_model_len"]) == (4096, 512)
        for model in (MODEL, OTHER, MODEL):
            answer = await client.post(
                "/v1/completions",
                json={"model": model, "prompt": "Hello there", "max_tokens": 3},
            )
            assert answer.status_code == 200, answer.text
            assert answer.json()["model"] == model
            assert answer.headers["x-pdserve-prefill-engine"] == f"{model}-prefill"
            assert answer.headers["x-pdserve-decode-engine"] == f"{model}-decode"
        # the other model's own front end: its context (512) refuses what the first's takes
        long = {"prompt": [1] * 600, "max_tokens": 3}
        refused = await client.post("/v1/completions", json={"model": OTHER, **long})
        assert refused.status_code == 400, refused.text
        accepted = await client.post("/v1/completions", json={"model": MODEL, **long})
        assert accepted.status_code == 200, accepted.text
    metric = "pdserve_router_model_requests_total"
    assert sample(rt, metric, model=MODEL, outcome="ok") == 3  # type: ignore[arg-type]
    assert sample(rt, metric, model=OTHER, outcome="ok") == 1  # type: ignore[arg-type]


async def test_an_unknown_model_is_vllms_404_and_labels_no_metric(
    other_checkpoint: Path,
) -> None:
    rt = two_models(FakeFactory(), other_checkpoint)
    async with http(rt) as client:  # type: ignore[arg-type]
        answer = await client.post(
            "/v1/chat/completions",
            json={"model": "nobody", "messages": [{"role": "user", "content": "hi"}]},
        )
    assert answer.status_code == 404
    assert answer.json()["error"] == {
        "message": "The model `nobody` does not exist. Valid aliases: tiny, other.",
        "type": "NotFoundError",
        "param": "model",
        "code": 404,
    }
    labels = {
        sample.labels.get("model")
        for family in rt.metrics.registry.collect()  # type: ignore[attr-defined]
        for sample in family.samples
        if "model" in sample.labels
    }
    assert "nobody" not in labels


def test_states_choose_a_served_model_or_the_first() -> None:
    states = ModelStates(State())
    first, second = State(), State()
    states.add("a", first)
    states.add("b", second)
    assert states.choose("b") == ("b", second)
    assert states.choose("nobody") == ("a", first)
    states.served_names.add_adapter(LoRAAdapter("sql", "/adapters/sql"), "b")
    assert states.choose("sql") == ("b", second)  # an adapter goes to its base model's state
    assert states.choose(None) == ("a", first)
    with pytest.raises(ValueError, match="served twice"):
        states.add("a", State())
    # an attribute of a model's state is read and set there (outside a request: the first's)
    first.server_load_metrics = 0
    states.server_load_metrics += 1
    assert (first.server_load_metrics, states.server_load_metrics) == (1, 1)
    states.runtime = "shared"
    assert not hasattr(first, "runtime") and states.runtime == "shared"
