"""``pdserve up --engine sim``: simulated engines in real processes behind the real router,
served to the ``openai`` client at no less than their profile's pace, and stopped cleanly."""

from __future__ import annotations

import threading
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


SCALINGS = {
    # replicas at start, planner bounds, the pools wanted, what up must say it did
    "prefill_up_decode_down": (
        ("--decode-replicas", "3"),
        ("--prefill-min=2", "--decode-max=1"),
        {"prefill-0", "prefill-1", "decode-0"},
        ("starting prefill-1", "draining decode-2", "draining decode-1"),
    ),
    "prefill_down_decode_up": (
        ("--prefill-replicas", "3"),
        ("--prefill-max=1", "--decode-min=2"),
        {"prefill-0", "decode-0", "decode-1"},
        ("starting decode-1", "draining prefill-2", "draining prefill-1"),
    ),
}


@pytest.mark.parametrize("scaling", SCALINGS)
def test_autoscale_starts_and_drains_engines_as_the_planner_decides(
    tmp_path: Path, scaling: str
) -> None:
    """``--autoscale``: the planner (bounds given through ``--planner-arg``) wants more engines
    in one pool and fewer in the other than run: ``pdserve up`` starts the missing ones and
    drains the others, newest first, while a client streams requests that all complete (no
    request lost to the drains: a drained prefill engine keeps the KV it holds until its
    consumer has read it)."""
    replicas, bounds, wanted, said = SCALINGS[scaling]
    profile = load_profile()
    up = UpSystem(
        tmp_path,
        "--engine", "sim", "--sim-profile", profile.name, *replicas,
        "--autoscale", "--autoscale-poll-s", "0.5",
        "--planner-arg=--interval-s=1", "--planner-arg=--stabilization-intervals=3",
        *(f"--planner-arg={bound}" for bound in bounds),
    )  # fmt: skip
    outcomes: list[str] = []
    done = threading.Event()

    def client_loop() -> None:
        client = openai.OpenAI(base_url=f"{up.url}/v1", api_key="unused", max_retries=0)
        while not done.is_set():
            try:
                stream = client.completions.create(
                    model=profile.served_model, prompt="Hello", max_tokens=40, stream=True
                )
                text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
                outcomes.append("ok" if len(text.split()) == 40 else f"short: {text!r}")
            except openai.OpenAIError as exc:
                outcomes.append(f"{type(exc).__name__}: {exc}")

    try:
        up.wait_ready()
        assert "planner" in up.endpoints["metrics"]
        loader = threading.Thread(target=client_loop, daemon=True)
        loader.start()
        deadline = time.monotonic() + 180
        while set(up.read_endpoints()["engines"]) != wanted and time.monotonic() < deadline:
            time.sleep(0.5)
        done.set()
        loader.join(timeout=60)
        engines = up.read_endpoints()["engines"]
        assert set(engines) == wanted, (engines, up.output())
        assert outcomes and set(outcomes) == {"ok"}, outcomes
        output = up.output()
        for line in said:
            assert line in output, (line, output)
    finally:
        done.set()
        pids = [engine["pid"] for engine in up.endpoints.get("engines", {}).values()]
        status = up.stop()
        assert status == 0, up.output()
        assert no_processes_left(pids) == []
