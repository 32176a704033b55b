"""Every PP x TP layout of the reference engine gives the unsharded model's tokens.

One engine per layout (rank processes, gloo, NIXL pools, handshakes in a real Redis); each runs
three prompts at once (continuous batching), greedy and seeded-sampled, and must match what the
unsharded model computes in this process with the same sampler.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.requests import SamplingParams
from services.tokenization.tokenizer import load_tokenizer
from tests.integration.engines.conftest import (
    PROMPTS,
    collect,
    reference_tokens,
    running_engine,
    wait_until_free,
)

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(
    max_tokens=12, temperature=0.9, top_p=0.9, top_k=50, seed=1234, ignore_eos=True
)

LAYOUTS = [
    pytest.param(1, 1, None, id="pp1-tp1"),
    pytest.param(2, 1, None, id="pp2-tp1"),
    pytest.param(3, 1, (2, 4, 1), id="pp3-uneven-2-4-1"),
    pytest.param(1, 2, None, id="pp1-tp2"),
    pytest.param(2, 2, None, id="pp2-tp2"),
]


@pytest.fixture(scope="module")
def expected(tiny_model_dir: Path) -> dict[str, list[list[int]]]:
    tokenizer = load_tokenizer(tiny_model_dir)
    prompts = [tokenizer.encode(text) for text in PROMPTS]
    return {
        "prompts": prompts,
        "greedy": [reference_tokens(tiny_model_dir, p, GREEDY) for p in prompts],
        "seeded": [reference_tokens(tiny_model_dir, p, SEEDED) for p in prompts],
    }


@pytest.mark.parametrize(("pp", "tp", "partition"), LAYOUTS)
async def test_layout_matches_unsharded_model_greedy_and_seeded(
    module_cp_settings: ControlPlaneSettings,
    tiny_model_dir: Path,
    expected: dict[str, list[list[int]]],
    pp: int,
    tp: int,
    partition: tuple[int, ...] | None,
) -> None:
    engine_id = f"layout-pp{pp}-tp{tp}"
    async with running_engine(
        module_cp_settings,
        tiny_model_dir,
        engine_id=engine_id,
        role=EngineRole.PREFILL,
        pp=pp,
        tp=tp,
        partition=partition,
    ) as engine:
        prompts = expected["prompts"]
        runs = [collect(engine, f"g{i}", prompt, GREEDY) for i, prompt in enumerate(prompts)] + [
            collect(engine, f"s{i}", prompt, SEEDED) for i, prompt in enumerate(prompts)
        ]
        results = await asyncio.gather(*runs)
        greedy = [tokens for tokens, _ in results[: len(prompts)]]
        seeded = [tokens for tokens, _ in results[len(prompts) :]]
        assert greedy == expected["greedy"]
        assert seeded == expected["seeded"]
        assert len(set(map(tuple, expected["greedy"]))) == len(prompts)  # not a degenerate model
        await wait_until_free(engine)
