"""The prefix-aware policy over engines' real prefix caches, through ``pdserve up`` with two
prefill engines (reference engine): a repeated prompt prefix lands on the engine that holds
it, which reports it in ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from services.engines.reference.tiny_model import make_tiny_model
from tests.e2e.up_system import UpSystem

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "tiny-model"
HEARTBEAT_S = 2.0
"""The engines' heartbeat interval (the control plane's default)."""


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UpSystem]:
    model_dir = tmp_path_factory.mktemp("model") / MODEL
    make_tiny_model(model_dir)
    up = UpSystem(
        tmp_path_factory.mktemp("up-prefix"),
        "--model",
        str(model_dir),
        "--prefill-replicas",
        "2",
        # Cached prompts still go through a prefill engine (no local shortcut).
        env={"PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2", "PDSERVE_ROUTER_POLICY": "prefix_aware"},
    )
    try:
        yield up.wait_ready()
    finally:
        assert up.stop() == 0, up.output()


def complete(pd: UpSystem, prompt: str) -> tuple[str, int]:
    response = httpx.post(
        f"{pd.url}/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    details = response.json()["usage"].get("prompt_tokens_details") or {}
    return response.headers["x-pdserve-prefill-engine"], int(details.get("cached_tokens") or 0)


def test_a_repeated_prefix_lands_where_the_engine_reports_it_cached(pd: UpSystem) -> None:
    shared = "The prefill engine keeps the blocks of this long shared system prompt. " * 6
    engine, cached = complete(pd, shared + "First question?")
    assert cached == 0
    engines = {engine}
    for index in range(3):
        # Past two heartbeats, so the engine's own report of its cache has replaced this
        # router's record of what it sent there (a slow heartbeat only weakens the check).
        time.sleep(2.5 * HEARTBEAT_S)
        again, cached = complete(pd, f"{shared}Question number {index}?")
        assert again == engine
        assert cached > 0
        # Unrelated prompts (no block in common, from the first token on) rotate over the
        # engines as a plain least-loaded choice would.
        other, _ = complete(pd, f"{index} {'xyz' * index} unrelated words here.")
        engines.add(other)
    assert len(engines) == 2  # both prefill engines served requests
