"""Repeated prompts through vLLM PD at vLLM's own CPU block size (issue 29's reproduction).

``pdserve up --engine vllm --prefill-pp 2`` in push mode with vLLM's default block size (128
tokens on CPUs) answered a repeated 128-token prompt with a 504 after 60 s: the decode engine's
prefix cache held the whole prompt, it registered no block, the producer's writer asserted and
nobody told the decode engine. Here the same layout (prefill PP=2 pushing into a decode PP=1,
engines in this process, real Redis and NIXL, float32) sends prompts of 1x, 2x and 1x + 1 blocks
and one shorter than a block, fresh and then again: greedy equal to colocated vLLM every time,
every full hit counted once on the decode engine, WRITEs only for the requests whose blocks the
decode engine lacked, no failure, and the producer's pool free with no lease run out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest_asyncio

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.vllm.backend import VllmBackend
from services.engines.vllm.layouts import TransferMode
from tests.integration.engines import test_vllm_layouts
from tests.integration.engines.test_vllm_layouts import (
    assert_producer_freed,
    colocated,
    counted,
    disaggregated,
    failures,
    model_dir,
    prompt,
    settings,
    step_until,
    vllm_engine,
)

pytestmark = test_vllm_layouts.pytestmark  # vLLM in this process: the same marks

__all__ = ["model_dir", "settings"]  # module fixtures shared with the layouts module

CPU_BLOCK = 128
"""vLLM's default block size on CPUs (the engines below leave it to vLLM)."""
LENGTHS = (CPU_BLOCK, 2 * CPU_BLOCK, CPU_BLOCK + 1, CPU_BLOCK // 2)
FULL = sum(1 for length in LENGTHS if length % CPU_BLOCK == 0)
"""Prompts a decode engine that served them once holds whole."""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def prefill(settings: ControlPlaneSettings, model_dir: Path) -> AsyncIterator[VllmBackend]:
    async with vllm_engine(
        settings, model_dir, "pre-push-pp2", EngineRole.PREFILL, 2, 1,
        transfer_mode=TransferMode.PUSH, block_size=None,
    ) as engine:  # fmt: skip
        yield engine


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def decode(settings: ControlPlaneSettings, model_dir: Path) -> AsyncIterator[VllmBackend]:
    async with vllm_engine(
        settings, model_dir, "dec-push-pp1", EngineRole.DECODE, 1, 1,
        transfer_mode=TransferMode.PUSH, block_size=None,
    ) as engine:  # fmt: skip
        yield engine


async def test_repeated_prompts_at_the_cpu_block_size_push_only_what_the_decode_lacks(
    prefill: VllmBackend, decode: VllmBackend
) -> None:
    writes = prefill.transfers
    assert writes is not None
    prompts = [prompt(length, 900 + i) for i, length in enumerate(LENGTHS)]
    wanted = [await colocated(prefill, tokens) for tokens in prompts]
    released = counted(decode, "released")
    rounds = 3  # the first one fresh: everything moves
    for round_ in range(rounds):
        for tokens, want in zip(prompts, wanted, strict=True):
            got = await disaggregated(prefill, decode, tokens)
            assert got == want, f"round {round_}, prompt of {len(tokens)} tokens"
    # Both prefill stages WRITE every request the decode engine lacked a block of.
    pushed = 2 * (len(prompts) + (rounds - 1) * (len(prompts) - FULL))
    whole = released + (rounds - 1) * FULL
    await step_until(decode, lambda: counted(decode, "released") >= whole)
    await step_until(prefill, lambda: writes.transfers >= pushed)
    assert (writes.transfers, counted(decode, "released")) == (pushed, whole)
    assert failures(prefill) == 0 and failures(decode) == 0
    await assert_producer_freed(prefill)
