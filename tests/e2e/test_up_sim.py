"""``pdserve up --engine sim``: simulated engines in real processes behind the real router,
served to the ``openai`` client at no less than their profile's pace, and stopped cleanly."""

from __future__ import annotations

import time
from pathlib import Path

import openai
import pytest

from services.engines.sim import load_profile
from tests.e2e.up_system import UpSystem, no_processes_left

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MAX_TOKENS = 50


def test_pdserve_up_serves_simulated_engines_at_the_profiles_pace(tmp_path: Path) -> None:
    profile = load_profile()
    up = UpSystem(tmp_path, "--engine", "sim", "--sim-profile", profile.name)
    try:
        up.wait_ready()
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0)
        assert [model.id for model in client.models.list()] == [profile.served_model]
        started = time.monotonic()
        stream = client.completions.create(
            model=profile.served_model, prompt="Hello, world!", max_tokens=MAX_TOKENS, stream=True
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        elapsed_ms = (time.monotonic() - started) * 1000
        assert len(text.split()) == MAX_TOKENS
        # Every token after the prefill's first is one decode step: at least the step's base.
        assert elapsed_ms >= (MAX_TOKENS - 1) * profile.decode.base_ms
        assert up.metric("pdserve_router_execution_path_total", path="disaggregated") >= 1
    finally:
        pids = [engine["pid"] for engine in up.endpoints.get("engines", {}).values()]
        status = up.stop()
        assert status == 0, up.output()
        assert no_processes_left(pids) == []
