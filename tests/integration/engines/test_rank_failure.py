"""A rank process that dies fails the engine promptly: in-flight and later requests raise
``EngineFailed`` instead of hanging."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from services.config import ControlPlaneSettings
from services.control_plane.wire import EngineRole
from services.engines.errors import EngineFailed
from services.engines.requests import DecodeRequest, PrefillRequest, SamplingParams
from tests.integration.engines.conftest import PROMPTS, running_engine

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

DETECTION_BOUND_S = 10.0


async def test_killed_rank_fails_in_flight_and_later_requests(
    module_cp_settings: ControlPlaneSettings, tiny_model_dir: Path
) -> None:
    async with running_engine(
        module_cp_settings, tiny_model_dir, engine_id="doomed", role=EngineRole.PREFILL, pp=2
    ) as engine:
        prompt = tuple(engine.tokenizer.encode(PROMPTS[0]))
        stream = engine.decode(
            DecodeRequest("victim", prompt, SamplingParams(max_tokens=200, ignore_eos=True))
        )
        await anext(stream)
        os.kill(engine.rank_pids()[(1, 0)], signal.SIGKILL)
        killed_at = time.monotonic()

        async def drain() -> None:
            async for _ in stream:
                pass

        with pytest.raises(EngineFailed):
            await asyncio.wait_for(drain(), DETECTION_BOUND_S)
        assert time.monotonic() - killed_at < DETECTION_BOUND_S
        assert engine.failure is not None and "(1, 0)" in str(engine.failure)
        with pytest.raises(EngineFailed):
            await engine.prefill(PrefillRequest("after", prompt, SamplingParams()))
